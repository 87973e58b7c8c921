"""Test instrumentation for the fixture scripts. With SEED_AT_START=<n>, each training rank seeds torch
with n at interpreter start: scripts that never seed (the CIFAR example) otherwise start from torch's
random default seed, and their losses could not be compared with a recorded run. Then, with
RECORD_LOSSES=<dir>, every loss passed to `engine.backward` is recorded and written to
<dir>/losses_rank<RANK>.json at exit, for zerodp's adapter (RECORD_ENGINE=zerodp) or real DeepSpeed
(RECORD_ENGINE=deepspeed, in the bench venv). Scripts print their losses rounded or not at all; this
reads them exactly without editing the scripts."""

import os

if os.environ.get("SEED_AT_START") and os.environ.get("RANK") is not None:
    import torch

    torch.manual_seed(int(os.environ["SEED_AT_START"]))

if os.environ.get("RECORD_LOSSES"):
    import atexit
    import json

    _losses = []

    def _install():
        if os.environ.get("RECORD_ENGINE") == "deepspeed":
            from deepspeed.runtime.engine import DeepSpeedEngine
        else:
            from zerodp.deepspeed.engine import DeepSpeedEngine
        original = DeepSpeedEngine.backward

        def backward(self, loss, *args, **kwargs):
            _losses.append(float(loss.detach().float().item()))
            return original(self, loss, *args, **kwargs)

        DeepSpeedEngine.backward = backward

    def _write():
        path = os.path.join(os.environ["RECORD_LOSSES"], f"losses_rank{os.environ.get('RANK', '0')}.json")
        with open(path, "w") as f:
            json.dump(_losses, f)

    if os.environ.get("RANK") is not None:  # a training rank, not torchrun's launcher
        _install()
        atexit.register(_write)

if os.environ.get("RECORD_ENGINE") == "deepspeed" and os.environ.get("RANK") is not None:
    # Recording real DeepSpeed on this CPU-only torch: DeepSpeed hands "cpu:gloo,cuda:nccl" to torch, which
    # refuses it without NCCL; keep the gloo entry, as zerodp.deepspeed.init_distributed does.
    import torch as _torch
    import torch.distributed as _dist

    _init_process_group = _dist.init_process_group

    def _init_without_nccl(backend=None, *args, **kwargs):
        # NCCL built is not a GPU present (zerodp/comm/backend.py): a CUDA torch without a GPU refuses it too
        if isinstance(backend, str) and ":" in backend and not (_dist.is_nccl_available() and _torch.cuda.is_available()):
            backend = ",".join(e for e in backend.split(",") if not e.strip().endswith(":nccl"))
        return _init_process_group(backend, *args, **kwargs)

    _dist.init_process_group = _init_without_nccl

if os.environ.get("TRANSFORMERS4_NAMES") and os.environ.get("RANK") is not None:
    # DeepSpeed-Chat was written for transformers 4, which exported no_init_weights from modeling_utils;
    # transformers 5 (installed here) moved it to transformers.initialization. Re-export it under the old
    # name (the same function), for real DeepSpeed and zerodp alike. Done when the script first imports
    # transformers.modeling_utils, not here: importing transformers at interpreter start would evaluate
    # transformers.integrations.deepspeed (which asks whether DeepSpeed is installed) before
    # zerodp.deepspeed.run has installed its `deepspeed` alias, unlike a run without this shim.
    import importlib.abc
    import importlib.machinery
    import sys

    class _ReexportNoInitWeights(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != "transformers.modeling_utils":
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            exec_module = spec.loader.exec_module

            def exec_and_reexport(module):
                exec_module(module)
                import transformers.initialization

                module.no_init_weights = transformers.initialization.no_init_weights

            spec.loader.exec_module = exec_and_reexport
            return spec

    sys.meta_path.insert(0, _ReexportNoInitWeights())
