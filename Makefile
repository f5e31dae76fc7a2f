# `make test` and `make demo` are the README's two commands; both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo install lint clean gpu-check

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
	$(BIN)/python -m pytest -q tests $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/poodle demo

# The GPU check (docs/gpu.md): on a GPU machine that already has torch, torchvision, h5py, click, rich
# and timm, and no network: `pip install --no-deps --no-build-isolation -e .` then `make gpu-check`.
# Uses that Python (no venv). Keeps to a budget, set-up included (--budget, default 300 s: five
# minutes); rewrites gpu-report.md and gpu-report.json after every section. GPU_CHECK_ARGS passes
# options (--budget S, --out-dir DIR, --skip NAMES, --authors-code DIR).
gpu-check:
	$(PYTHON) benchmarks/gpu.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
