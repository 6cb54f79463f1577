# Two commands for a fresh machine:  make demo   and   make test   (CI: .ci/run = make lint test)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LINTED := kvstore cli tests experiments

.PHONY: setup demo test lint format clean-venv

$(STAMP): setup.cfg pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) VENV=$(VENV) sh scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) experiments/demo.py

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix $(LINTED)
	$(VENV)/bin/ruff format $(LINTED)

clean-venv:
	rm -rf $(VENV)
