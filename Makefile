# Set up the pinned environment in .venv (idempotent: reinstalls only when
# pyproject.toml changes) and run things inside it.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv test run clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip "setuptools<70" wheel
	$(BIN)/python -m pip install --quiet -e ".[test,server]"
	@touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -q

run: venv
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/mlflow run . -e main -P spec=synthetic --experiment-name synthetic --env-manager local

clean-venv:
	rm -rf $(VENV)
