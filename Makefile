# `make test` and `make demo` are the README's two commands; both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo install lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

DEV_STAMP := $(VENV)/.installed-dev

$(DEV_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(DEV_STAMP) $(STAMP)

# ruff (lint + format check) and mypy on the library and the command line
lint: $(DEV_STAMP)
	$(BIN)/ruff check poodle cli tests benchmarks
	$(BIN)/ruff format --check poodle cli tests benchmarks
	$(BIN)/mypy poodle cli

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

demo: $(STAMP)
	$(BIN)/poodle demo

clean:
	rm -rf $(VENV) build dist *.egg-info
