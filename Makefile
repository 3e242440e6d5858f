# Every target creates and uses .venv when it is missing; PyTorch is pinned to the CPU build on disk.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: run chat test bench lint setup model proto clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

setup: $(STAMP)

model: setup  ## assemble and convert the embedded model (cached after the first run)
	$(BIN)/python -m kiln.models.embedded

run: model  ## serve the embedded model: gRPC on 127.0.0.1:50051, HTTP (OpenAI API) on 127.0.0.1:8000
	$(BIN)/kiln serve

chat: model  ## interactive chat in process, with per-turn cache statistics
	$(BIN)/kiln chat

test: model
	$(BIN)/ruff check kiln tests bench
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev,bench]'
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/long_session.py
	$(BIN)/python bench/prefill_fairness.py
	$(BIN)/python bench/step_cost.py
	$(BIN)/python bench/weight_formats.py

proto: setup  ## regenerate the checked-in message module from proto/kiln/v1/runtime.proto
	$(BIN)/python proto/generate.py

lint: setup
	$(BIN)/ruff check kiln tests bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
