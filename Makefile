# The two commands a new user runs: `make demo` and `make test`.
SHELL := /bin/bash
VENV := .venv
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PYTHONHASHSEED ?= 0
# The venv is shared between clones (cached by pins); this clone's code must win over whichever
# clone did the last editable install.
export PYTHONPATH := $(CURDIR)/src:$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: install demo test lint clean

install:
	@bash scripts/install.sh

demo: install
	$(VENV)/bin/rlpipe demo

test: install
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf .rlpipe .pytest_cache
