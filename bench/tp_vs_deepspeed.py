"""TP 2 x DP 2: DeepSpeed 0.19.8 against zerodp on the tensor-parallel GPT of tests/dist/tensor_parallel_common.py
(dropout with the model-parallel RNG tracker, GAS 2, clipping 0.05 on every step, 3 steps), 4 gloo ranks, both
through DeepSpeed's API with `mpu=` (zerodp.tensor_parallel.ModelParallelUnit). Prints one JSON line per rank (bench/results/tp_vs_deepspeed.jsonl holds them):
per-micro-step losses and per-step global gradient norms. Run (results in bench/results/tp_vs_deepspeed.md):

    DS_ACCELERATOR=cpu ENGINE=deepspeed STAGE=1 bench/.venv/bin/python -m torch.distributed.run --nproc_per_node 4 bench/tp_vs_deepspeed.py
    ENGINE=zerodp STAGE=1 .venv/bin/python -m torch.distributed.run --nproc_per_node 4 bench/tp_vs_deepspeed.py

DeepSpeed finds tensor-parallel parameters by Megatron's attribute, so the script sets
`tensor_model_parallel`/`partition_dim`/`partition_stride` from `tensor_parallel_specs(model)` for both engines.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.dist.tensor_parallel_common import CFG, GAS, SEED, config, make_optimizer, micro_batch  # noqa: E402
from zerodp.tools.models.tp_gpt import TensorParallelGPT, tp_lm_loss  # noqa: E402
from zerodp.tensor_parallel import (ModelParallelUnit, RNGStatesTracker, seed_model_parallel,  # noqa: E402
                                    tensor_parallel_specs)

ENGINE, STAGE, STEPS = os.environ["ENGINE"], int(os.environ["STAGE"]), int(os.environ.get("STEPS", "3"))
OPT = os.environ.get("OPT", "adamw")
if ENGINE == "deepspeed":
    import deepspeed
else:
    import zerodp.deepspeed as deepspeed
deepspeed.init_distributed("gloo")
import torch.distributed as dist  # noqa: E402

mpu = ModelParallelUnit(2)
tracker = RNGStatesTracker("cpu")
model = TensorParallelGPT(CFG, mpu, rng=tracker, seed=SEED)
params = dict(model.named_parameters())
MARK = os.environ.get("MARK", "1") == "1"  # MARK=0: no attributes (DeepSpeed then counts every parameter once)
for name, spec in (tensor_parallel_specs(model) if MARK else {}).items():  # Megatron's attributes, DeepSpeed reads them
    params[name].tensor_model_parallel = True
    params[name].partition_dim, params[name].partition_stride = spec.dim, spec.stride
cfg = config(STAGE)
engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(OPT, model.parameters()), config=cfg, mpu=mpu)
seed_model_parallel(tracker, SEED, mpu.get_tensor_model_parallel_rank())
losses, norms = [], []
for step in range(STEPS):
    for micro in range(GAS):
        x, y = micro_batch(step, micro, mpu.get_data_parallel_rank())
        loss = tp_lm_loss(engine(x), y, mpu.get_tensor_model_parallel_group())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    norm = engine.get_global_grad_norm()
    norms.append(float(norm) if norm is not None else None)
line = json.dumps({"engine": ENGINE, "stage": STAGE, "opt": OPT, "marked": MARK, "rank": dist.get_rank(),
                   "tp": mpu.get_tensor_model_parallel_rank(), "dp": mpu.get_data_parallel_rank(),
                   "losses": losses, "grad_norms": norms})
for r in range(dist.get_world_size()):  # one rank at a time: lines printed together interleave
    if r == dist.get_rank():
        print(line, flush=True)
    dist.barrier()
mpu.destroy()
dist.destroy_process_group()
