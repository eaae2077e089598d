# Environments (idempotent: each reinstalls only when pyproject.toml changes) and tests.
#   .venv      the DGL stack (torch 2.2.1, dgl 2.1.0, numpy<2) plus PyG: both backends
#   .venv-pyg  the modern stack: torch $(PYG_TORCH), PyG, numpy 2, no DGL
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

PYG_VENV  := .venv-pyg
PYG_BIN   := $(PYG_VENV)/bin
PYG_STAMP := $(PYG_VENV)/.installed
# Pinned: this version's CPU wheel is on the local disk here; any other version
# (or an unpinned torch) makes pip download a multi-GB CUDA build.
PYG_TORCH := 2.13.0
PYG_TORCH_STAMP := $(PYG_VENV)/.torch-$(PYG_TORCH)

.PHONY: venv venv-pyg venv-pyg-torch test test-dgl test-slow test-pyg run clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip "setuptools<70" wheel
	$(BIN)/python -m pip install --quiet -e ".[dgl,pyg,kaminpar,test,server]"
	@touch $(STAMP)

venv-pyg: $(PYG_STAMP)

# torch alone first: it touches nothing in the source tree, so `make -j2 venv venv-pyg-torch`
# installs it beside .venv (the editable installs write betty.egg-info: one at a time)
venv-pyg-torch: $(PYG_TORCH_STAMP)

$(PYG_TORCH_STAMP):
	@test -x $(PYG_BIN)/python || $(PYTHON) -m venv $(PYG_VENV)
	$(PYG_BIN)/python -m pip install --quiet --upgrade pip wheel
	$(PYG_BIN)/python -m pip install --quiet "torch==$(PYG_TORCH)"
	@touch $(PYG_TORCH_STAMP)

$(PYG_STAMP): pyproject.toml $(PYG_TORCH_STAMP)
	$(PYG_BIN)/python -m pip install --quiet "torch==$(PYG_TORCH)" -e ".[pyg,kaminpar,test,server]"
	@if $(PYG_BIN)/python -c "import dgl" 2>/dev/null; then \
		echo "$(PYG_VENV) must not contain DGL"; exit 1; fi
	@touch $(PYG_STAMP)

# The full suite on the DGL stack in two parts, the slow tests (marker `slow`: the
# `mlflow run` end-to-end, interrupt and deep-RevGNN tests) and the rest; then, without
# DGL, what only the modern stack can show: the PyG backend, the library on torch
# $(PYG_TORCH) and numpy 2. The workflow-layer tests (marker `workflow`) and the slow ones
# (both backends' halves ran in .venv) run once. `make -j2 test` (CI) runs the three
# passes two at a time, so neither core waits while one long pass finishes.
PYTEST := -m pytest -q --durations=25

test: test-dgl test-slow test-pyg

test-dgl: venv
	$(BIN)/python $(PYTEST) -m "not slow"

test-slow: venv
	$(BIN)/python $(PYTEST) -m slow

test-pyg: venv-pyg
	$(PYG_BIN)/python $(PYTEST) -m "not dgl and (not workflow or pyg) and not slow"

run: venv
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/mlflow run . -e main -P spec=synthetic --experiment-name synthetic --env-manager local

clean-venv:
	rm -rf $(VENV) $(PYG_VENV)
