# Two commands that work on a fresh machine: `make train` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test test-slow test-fast lock bench bench-offload bench-gpu clean

setup: $(STAMP)

# requirements/lock.txt: the versions the suite is known to pass with, installed as constraints (-c), so a
# fresh machine gets what CI tested; pyproject.toml keeps ranges for library users. `make lock` refreshes it.
LOCK := requirements/lock.txt
EXTRAS := test,plot,hf,monitor

# torch is pinned and installed first: an unpinned torch pulls gigabytes of CUDA wheels.
$(STAMP): pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c $(LOCK) pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c $(LOCK) -e ".[$(EXTRAS)]"
	touch $(STAMP)

train: setup
	$(BIN)/zerodp train

# The whole suite, every failure reported (no -x): the in-process unit tests first, then multi-rank on gloo,
# the Hugging Face integration, GPU (skipped without one) and end to end.
FAST_TESTS := tests/unit tests/e2e/test_cli.py tests/e2e/test_docs.py
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -rfE -m "not slow" tests/unit tests/dist tests/hf tests/gpu tests/e2e

# The long end-to-end runs `make test` leaves out to stay within 15 minutes on 2 cores (marked `slow`): a resume
# at other world sizes (also covered by tests/e2e/test_multinode.py) and `zerodp train` resuming an offloaded run.
test-slow: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -rfE -m slow tests/e2e

# The edit loop: unit and in-process tests only (well under a minute on 2 cores).
test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q $(FAST_TESTS)

# Re-resolve every dependency from pyproject.toml's ranges in a throwaway venv and write the lock. An upgrade is
# a deliberate commit: run `make test` with the new lock before committing it.
lock:
	rm -rf .lock-venv
	$(PY) -m venv .lock-venv
	.lock-venv/bin/pip install -q --upgrade pip
	.lock-venv/bin/pip install -q torch==2.13.0
	.lock-venv/bin/pip install -q ".[$(EXTRAS)]"
	{ head -3 $(LOCK); .lock-venv/bin/pip freeze --all --exclude zerodp --exclude setuptools --exclude wheel \
	  | sed 's/^torch==\(.*\)+cpu$$/torch==\1/' | sort -f; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf .lock-venv

# Side by side against DDP, torch's ZeroRedundancyOptimizer, FSDP1/2 and DeepSpeed (in its own venv:
# DeepSpeed is a peer to measure, never a dependency of zerodp). Needs an otherwise idle machine.
BENCH_VENV := bench/.venv
$(BENCH_VENV)/.installed:
	$(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q torch==2.13.0
	$(BENCH_VENV)/bin/pip install -q deepspeed==0.19.8 ninja datasets==5.2.0
	$(BENCH_VENV)/bin/pip install -q -e ".[plot]" torch==2.13.0
	touch $@

bench: $(BENCH_VENV)/.installed
	OMP_NUM_THREADS=1 $(BENCH_VENV)/bin/python -m bench.harness

# One GPU (issue 32): DDP, FSDP2, zerodp stages 1-3, CPU offload (zerodp, FSDP2), DeepSpeed where importable, at 254M and
# 1.3B, bf16; s/step, tokens/s, TFLOPS and peak CUDA bytes to bench/results/gpu_bench-<device>.md, about 5 minutes on an
# H100. Each run is its own process importing zerodp from src/ (GPU_PY: a python with torch and pydantic). On a
# machine without a GPU, `$(BIN)/python -m bench.gpu_bench --tiny` runs every strategy on a tiny GPT instead.
GPU_PY ?= python3
bench-gpu:
	$(GPU_PY) -m bench.gpu_bench

clean:
	rm -rf $(VENV) runs

# A 3e9-parameter GPT at stage 3 with nvme offload of optimizer and parameters on 2 CPU ranks (3 steps);
# not part of `make test`. NVME must be a directory on a fast local disk with ~50 GB free (24.6 GB per rank).
NVME ?= /tmp
bench-offload: setup
	THP_MEM_ALLOC_ENABLE=1 OMP_NUM_THREADS=1 $(BIN)/torchrun --nproc_per_node 2 -m bench.harness.big_offload --nvme-path $(NVME) --size 3b --steps 3
