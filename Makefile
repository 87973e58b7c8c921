# Two commands that work on a fresh machine: `make train` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test test-slow test-fast test-gpu gpu-wheels lock bench bench-offload bench-gpu clean

setup: $(STAMP)

# requirements/lock.txt: the versions the suite is known to pass with, installed as constraints (-c), so a
# fresh machine gets what CI tested; pyproject.toml keeps ranges for library users. `make lock` refreshes it.
LOCK := requirements/lock.txt
# frameworks: Lightning (12 packages, 34 MB installed), so that `make test` runs tests/e2e/test_lightning.py
EXTRAS := test,plot,hf,monitor,frameworks

# torch is pinned and installed first: an unpinned torch pulls gigabytes of CUDA wheels.
$(STAMP): pyproject.toml setup.py $(LOCK)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c $(LOCK) pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c $(LOCK) -e ".[$(EXTRAS)]"
	touch $(STAMP)

train: setup
	$(BIN)/zerodp train

# The whole suite, every failure reported (no -x): the in-process unit tests first, then multi-rank on gloo,
# the Hugging Face integration and end to end; then the GPU tests (skipped without one) in a pytest process of
# their own, so that their NCCL group and ZERODP_REAL_COLLECTIVES never reach another test on a GPU host
# ([Note: nothing after tests/gpu sees its group] in tests/gpu/one_rank.py). The first run hides any GPU
# (CUDA_VISIBLE_DEVICES=): on a GPU host it tests what CI tests (2 gloo ranks per job, CPU tensors), which
# `zerodp train`'s GPU defaults would otherwise change (e.g. --nproc 2 on one GPU is refused). Fails if either failed.
# Every test's wall and CPU seconds go to $(DURATIONS)/<target>.csv (tests/duration_log.py), which CI keeps; each
# run ends with its ten slowest tests and a report of any test over 30 s neither marked `slow` nor in tests/e2e/.
FAST_TESTS := tests/unit tests/e2e/test_cli.py tests/e2e/test_docs.py
DURATIONS := .ci/durations
LOG_DURATIONS = -p tests.duration_log --duration-log $(DURATIONS)/$(1).csv
test: setup
	CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -rfE $(call LOG_DURATIONS,test) -m "not slow" tests/unit tests/dist tests/hf tests/e2e; \
	cpu=$$?; OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -rfE $(call LOG_DURATIONS,test-gpu) -m "not slow" tests/gpu; gpu=$$?; \
	test $$cpu -eq 0 -a $$gpu -eq 0

# The long end-to-end runs `make test` leaves out to stay within 15 minutes on 2 cores (marked `slow`; README's
# "Two commands" lists them). Every slow test lives in tests/e2e.
test-slow: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -rfE $(call LOG_DURATIONS,test-slow) -m slow tests/e2e

# The edit loop: unit and in-process tests only, under a minute on 2 cores: the tests marked `heavy` (a few
# seconds of CPU each: a subprocess, an engine's steps) are left to `make test`. The duration log's CPU seconds
# show what to mark when it grows.
test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q $(call LOG_DURATIONS,test-fast) -m "not heavy and not slow" $(FAST_TESTS)

# One GPU, on a lent GPU machine as it is (docs/gpu.md): tests/gpu with the machine's python3 (its CUDA torch)
# and the wheels of `make gpu-wheels`; under 8 minutes; logs under $$OUT (or gpu-out/). Needs no venv.
test-gpu:
	bash tools/gpu_run.sh

# The lock's wheels a GPU image lacks (pydantic and its parts; the lock's transformers), for CPython 3.12 on
# x86-64, into .gpu-wheels/ (ignored; the device tool carries it): a lent GPU has no internet.
GPU_WHEELS := .gpu-wheels
GPU_WHEEL_NAMES := pydantic pydantic_core annotated-types typing-inspection typing_extensions transformers
gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d $(GPU_WHEELS) $$(for n in $(GPU_WHEEL_NAMES); do grep -i "^$$n==" $(LOCK) || echo "MISSING-$$n"; done)
	@ls $(GPU_WHEELS)

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
# H100. Like test-gpu it runs with the machine's python3 and .gpu-wheels (tools/gpu_run.sh), results under $$OUT
# (or gpu-out/). On a machine without a GPU, `$(BIN)/python -m bench.gpu_bench --tiny` runs every strategy on a
# tiny GPT instead.
bench-gpu:
	bash tools/gpu_run.sh bench

clean:
	rm -rf $(VENV) runs

# A 3e9-parameter GPT at stage 3 with nvme offload of optimizer and parameters on 2 CPU ranks (3 steps);
# not part of `make test`. NVME must be a directory on a fast local disk with ~50 GB free (24.6 GB per rank).
NVME ?= /tmp
bench-offload: setup
	THP_MEM_ALLOC_ENABLE=1 OMP_NUM_THREADS=1 $(BIN)/torchrun --nproc_per_node 2 -m bench.harness.big_offload --nvme-path $(NVME) --size 3b --steps 3
