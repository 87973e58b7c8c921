# Two commands that work on a fresh machine: `make train` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test bench bench-offload clean

setup: $(STAMP)

# torch is pinned and installed first: an unpinned torch pulls gigabytes of CUDA wheels.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,plot,hf,monitor]" torch==2.13.0
	touch $(STAMP)

train: setup
	$(BIN)/zerodp train

test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -x tests

# Side by side against DDP, torch's ZeroRedundancyOptimizer, FSDP1/2 and DeepSpeed (in its own venv:
# DeepSpeed is a peer to measure, never a dependency of zerodp). Needs an otherwise idle machine.
BENCH_VENV := bench/.venv
$(BENCH_VENV)/.installed:
	$(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q torch==2.13.0
	$(BENCH_VENV)/bin/pip install -q deepspeed==0.19.8 ninja
	$(BENCH_VENV)/bin/pip install -q -e ".[plot]" torch==2.13.0
	touch $@

bench: $(BENCH_VENV)/.installed
	OMP_NUM_THREADS=1 $(BENCH_VENV)/bin/zerodp bench

clean:
	rm -rf $(VENV) runs

# A 3e9-parameter GPT at stage 3 with nvme offload of optimizer and parameters on 2 CPU ranks (3 steps);
# not part of `make test`. NVME must be a directory on a fast local disk with ~50 GB free (24.6 GB per rank).
NVME ?= /tmp
bench-offload: setup
	OMP_NUM_THREADS=1 $(BIN)/torchrun --nproc_per_node 2 -m zerodp.bench.big_offload --nvme-path $(NVME) --size 3b --steps 3
