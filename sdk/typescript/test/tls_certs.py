"""Writes the throwaway PKI of the Python TLS tests (tests/server/pki.py: CAs, server and client
certificates made by trustme) under the folder given, for the TypeScript SDK's TLS test, and prints the
files' paths by name as JSON."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tests.server.pki import write_pki  # noqa: E402 - needs the repository on the path

if __name__ == "__main__":
    print(json.dumps(write_pki(Path(sys.argv[1])).paths()))
