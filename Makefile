PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-sharded test-flink test-flink-thread lint format bench bench-peers fuzz soak clean bench-ratelimit bench-ltm

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH"; exit 1; }
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py
	@echo
	@echo "=== support triage: a chat agent with tools (scripted model, no network) ==="
	$(BIN)/python examples/support_triage/run.py

# A run that ends without pytest finishing its session (a test that ended the process, which
# exits 0 with every later test unrun) fails: tests/conftest.py writes FINISHED at its end.
FINISHED = $(VENV)/.pytest-finished
test: $(STAMP)
	@rm -f $(FINISHED)
	RATCHET_TEST_FINISHED=$(FINISHED) $(BIN)/python -m pytest -q -m "not slow"
	@test -f $(FINISHED) || { echo "pytest ended before its session did: a test ended the process"; exit 1; }

# The longest generated and kill tests (marked `slow`, two or three minutes): kept out of make test
# so it stays well under its 10 minutes; CI runs them right after it.
test-slow: $(STAMP)
	@rm -f $(FINISHED)
	RATCHET_TEST_FINISHED=$(FINISHED) $(BIN)/python -m pytest -q -m slow
	@test -f $(FINISHED) || { echo "pytest ended before its session did: a test ended the process"; exit 1; }

# Every kill test also with `--workers 2` (make test runs tests/kill/test_sharded.py and a few
# sharded crash-equivalence cases; this adds the longer variants, a few minutes).
test-sharded: $(STAMP)
	RATCHET_SHARDED_ALL=1 $(BIN)/python -m pytest -q tests/kill

# The Flink engine's suite, in its own environment (PyFlink is large and pins its own deps).
FLINK_VENV := .venv-flink
FLINK_STAMP := $(FLINK_VENV)/.installed-postgres
$(FLINK_STAMP):
	@test -x $(FLINK_VENV)/bin/python || $(PY) -m venv $(FLINK_VENV)
	$(FLINK_VENV)/bin/python -m pip install -q --upgrade pip
	$(FLINK_VENV)/bin/python -m pip install -q -e '.[flink,postgres]' pytest pytest-timeout
	@touch $(FLINK_STAMP)

# test-flink runs the suite in process mode (separate Python workers: the default with
# --jobmanager), test-flink-thread in thread mode (the Python code inside the TaskManager's JVM:
# the default on the local mini-cluster); CI runs both.
test-flink: $(FLINK_STAMP)
	RATCHET_FLINK_EXECUTION_MODE=process $(FLINK_VENV)/bin/python -m pytest -q -m flink tests/flink

test-flink-thread: $(FLINK_STAMP)
	RATCHET_FLINK_EXECUTION_MODE=thread $(FLINK_VENV)/bin/python -m pytest -q -m flink tests/flink

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples scripts
	$(BIN)/ruff format --check src tests benchmarks examples scripts
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks examples scripts
	$(BIN)/ruff check --fix src tests benchmarks examples scripts

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/run_all.py

# A chat model's RateLimit held under load against a local fake provider (about 30 s)
bench-ratelimit: $(STAMP)
	$(BIN)/python benchmarks/rate_limit_bench.py

# Long-term memory at 100,000 memories: adds/s and search latency beside plain baselines
# (about a minute)
bench-ltm: $(STAMP)
	$(BIN)/python benchmarks/ltm_bench.py

# ratchet beside LangGraph, DBOS, Flink Agents, PyFlink and plain asyncio: one venv per peer
# under .bench/ (about 2.8 GB), then one table (about 15 minutes). See docs/benchmarks.md.
bench-peers:
	bash benchmarks/peers/setup.sh || true  # a peer that fails to install shows as "not installed"
	$(PY) benchmarks/peers/run.py --repeat 3

# A million crafted and mutated blobs through the codec's decoder (atheris when it installs,
# else a random-mutation driver); INPUTS=N to change the count. About a minute.
fuzz: $(STAMP)
	$(BIN)/python -m pip install -q atheris || echo "atheris did not install: using the random-mutation driver"
	$(BIN)/python scripts/fuzz_codec.py --inputs $(or $(INPUTS),1000000)

# The crash-equivalence harness at scale: generated agents, hundreds of SIGKILLs of real
# `ratchet run` processes; CASES=N to change the count (make test runs a small budget).
soak: $(STAMP)
	$(BIN)/python tests/kill/soak.py --cases $(or $(CASES),150)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
