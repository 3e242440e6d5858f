"""Writes the tiny random llama model directory of the Python server tests (tests/server/conftest.py:
config.json, safetensors weights, a byte-level tokenizer with one token per byte) under the folder given,
for the TypeScript SDK's tests, and prints its path."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tests.server.conftest import tiny_model_dir  # noqa: E402 - needs the repository on the path

if __name__ == "__main__":
    print(tiny_model_dir(Path(sys.argv[1])))
