# The two commands a new user runs: `make demo` and `make test`.
SHELL := /bin/bash
# This clone's own venv (scripts/install.sh): the dependencies come from a venv shared between
# clones, rlpipe, flows and tasks from this clone's editable install. So no PYTHONPATH is set: the
# venv's python already imports this checkout, and so do the subprocesses the tests start.
VENV := .venv
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PYTHONHASHSEED ?= 0
TEST_WORKERS ?= 2

.PHONY: install demo demo-rlhf demo-agent test lint clean

install:
	@bash scripts/install.sh

demo: install
	$(VENV)/bin/rlpipe demo

demo-rlhf: install
	$(VENV)/bin/rlpipe demo rlhf

demo-agent: install
	$(VENV)/bin/rlpipe demo agent

test:
	@RLPIPE_INSTALL_BROWSER=1 RLPIPE_INSTALL_TEST_TOOLS=1 bash scripts/install.sh
	$(VENV)/bin/ruff check .
# TEST_WORKERS pytest processes (pytest-xdist), a test file each at a time: most of the drills' wall time is one
# process importing torch, Prefect and MLflow while the other core idles (2 workers: 41 -> 25 min on 2 cores).
# Each worker has its own session servers and RLPIPE_HOME; TEST_WORKERS=0 runs the suite in one process.
# The browser test in a process of its own: the memory the rest of the suite leaves in the first process would
# starve the browser, the worker and the servers it drives (its page loads failed at the suite's end).
ifeq ($(strip $(PYTEST_ARGS)),)
	$(VENV)/bin/python -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile --ignore=tests/ui
	$(VENV)/bin/python -m pytest -q --durations=5 tests/ui
else
	$(VENV)/bin/python -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
endif

# The linter alone (pyproject.toml's [tool.ruff]); `make test` runs it first.
lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf .rlpipe .pytest_cache
