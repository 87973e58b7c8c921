# Two commands that work on a fresh machine: `make train` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test clean

setup: $(STAMP)

# torch is pinned and installed first: an unpinned torch pulls gigabytes of CUDA wheels.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,plot]"
	touch $(STAMP)

train: setup
	$(BIN)/zerodp train

test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -x tests

clean:
	rm -rf $(VENV) runs
