"""One rank of the Accelerate acceptance run (tests/hf/test_frameworks_on_zerodp.py), launched with zerodp in
DeepSpeed's place, the only change:

    python -m torch.distributed.run --nproc_per_node 2 -m zerodp.deepspeed.run tests/hf/accelerate_worker.py OUT

An Accelerate user's loop (`accelerator.accumulate`, `accelerator.backward`, `clip_grad_norm_`, the user's own
AdamW and torch scheduler, both prepared) trains a small MLP with gradient accumulation 2, once per case, in one
process per rank (AcceleratorState is reset between cases); rank 0 writes OUT/accelerate.json with, per case, every
micro-batch's loss, every step's grad norm, the lr each optimizer step used (a global optimizer step pre-hook, so it
sees the optimizer that really steps), the final weights (`accelerator.get_state_dict`) and which optimizer class
stepped. Cases:
    ddp-steplr / ddp-lambda   Accelerate's own multi-process run without DeepSpeed (DDP, gloo): the references
    zero2-steplr              DeepSpeedPlugin(zero_stage=2, ...) in code; StepLR on the user's optimizer
    zero3-lambda              DeepSpeedPlugin(hf_ds_config={...stage 3...}, zero_stage=3); transformers' linear
                              schedule (a LambdaLR); `accelerator.save_state` after SAVE_AT steps
    zero3-lambda-resume       a fresh run: `accelerator.load_state` of that save, `skip_first_batches`, the rest
    zero2-offload-steplr      offload_optimizer cpu: Accelerate swaps the user's AdamW for DeepSpeedCPUAdam

On a machine without an accelerator, Accelerate gives a DeepSpeed run no process group of its own (its backend is
chosen from the device: none for a CPU without `cpu=True`, which in turn switches DeepSpeed off), so every rank would
read the whole data set as rank 0. `_cpu_backend` lifts only that rule, as the Lightning test lifts Lightning's two
CUDA checks: the backend is the one Accelerate picks for CPU processes (gloo). With a GPU it changes nothing.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import accelerate.accelerator
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DeepSpeedPlugin
from torch.optim.optimizer import register_optimizer_step_pre_hook
from transformers import get_scheduler

GAS, STEPS, SAVE_AT, MICRO, LR = 2, 4, 2, 4, 0.05
_prepare_backend = PartialState._prepare_backend


def _cpu_backend(self, cpu=False, sagemaker_dp=False, backend=None):
    """Accelerate's backend choice, with a CPU process group where it would give none (module docstring)."""
    found = _prepare_backend(self, cpu, sagemaker_dp, backend)
    if found[0] is None and not torch.cuda.is_available():
        return _prepare_backend(self, True, sagemaker_dp, backend)
    return found


PartialState._prepare_backend = _cpu_backend
SWAPPED = []  # the optimizers Accelerate handed to DeepSpeed's CPU optimizers (offload_optimizer), by class name
_to_deepspeed = accelerate.accelerator.map_pytorch_optim_to_deepspeed


def _recorded_swap(optimizer):
    built = _to_deepspeed(optimizer)  # deepspeed.ops.adam.DeepSpeedCPUAdam(...) under the alias
    SWAPPED.append(type(optimizer).__name__)
    return built


accelerate.accelerator.map_pytorch_optim_to_deepspeed = _recorded_swap


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 3, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)


def _plugin(case: str):
    if case.startswith("ddp"):
        return None
    if case.startswith("zero2"):  # the plugin's own arguments, no config file
        offload = "cpu" if "offload" in case else "none"
        return DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=GAS, gradient_clipping=1.0,
                               offload_optimizer_device=offload)
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": True}}
    return DeepSpeedPlugin(hf_ds_config=config, zero_stage=3)


def _scheduler(case: str, opt):
    if "steplr" in case:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    return get_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=2 * STEPS * 2)


def run(case: str, out: str) -> dict:
    SWAPPED.clear()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    plugin = _plugin(case)
    acc = Accelerator(gradient_accumulation_steps=GAS, cpu=plugin is None,
                      **({} if plugin is None else {"deepspeed_plugin": plugin}))
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = _scheduler(case, opt)
    model, opt, loader, sched = acc.prepare(model, opt, _loader(), sched)
    first = 0
    if case.endswith("resume"):
        acc.load_state(f"{out}/saved")
        first = SAVE_AT * GAS
        loader = acc.skip_first_batches(loader, first)
    used, stepped = [], set()

    def seen(optimizer, args, kwargs):
        used.append(sorted({float(g["lr"]) for g in optimizer.param_groups if g["params"]}))
        stepped.add(type(optimizer).__name__)

    hook = register_optimizer_step_pre_hook(seen)
    losses, norms = [], []
    for i, (x, y) in enumerate(loader, start=first):
        if i >= STEPS * GAS:
            break
        with acc.accumulate(model):
            loss = F.mse_loss(model(x), y)
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(loss.item())
        if case == "zero3-lambda" and i + 1 == SAVE_AT * GAS:
            acc.save_state(f"{out}/saved")
    hook.remove()
    weights = {k: v.float().flatten().tolist() for k, v in (acc.get_state_dict(model) or {}).items()}
    return {"loss": losses, "grad_norm": norms, "lr_used": [u for u in used if u], "weights": weights,
            "stepped": sorted(stepped), "swapped_for_cpu_optimizer": list(SWAPPED),
            "distributed_type": str(acc.distributed_type),
            "num_processes": acc.num_processes}


def main(out: str) -> None:
    cases = ["ddp-steplr", "ddp-lambda", "zero2-steplr", "zero3-lambda", "zero3-lambda-resume", "zero2-offload-steplr"]
    results = {case: run(case, out) for case in cases}
    if dist.get_rank() == 0:
        Path(out, "accelerate.json").write_text(json.dumps(results))


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    main(sys.argv[1])
