"""An Accelerate script as its users write it, run by tests/e2e/test_accelerate_launch.py twice:

    accelerate launch --multi_gpu --num_processes 2 accelerate_job.py --out DIR            (plain, DDP;
                                                 ACCELERATE_USE_CPU=true without a GPU)
    ZERODP_DEEPSPEED_ALIAS=1 accelerate launch --use_deepspeed --num_processes 2 --zero_stage 2 \\
        --gradient_clipping 1.0 accelerate_job.py --out DIR                               (zerodp)

The same model, data and seed; each step's loss (rank 0's micro-batch) and lr, and the final parameters,
go to DIR/run.pt (rank 0). Nothing in it names zerodp or DeepSpeed.

On a machine without an accelerator, Accelerate gives a DeepSpeed run no process group of its own (its backend is
chosen from the device: none for a CPU without `cpu=True`, which in turn switches DeepSpeed off), so every rank
would train alone as rank 0, with real DeepSpeed too. `_cpu_backend` lifts only that rule (as
tests/hf/accelerate_worker.py does): the backend is the one Accelerate picks for CPU processes (gloo). With a GPU
it changes nothing.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from torch.utils.data import DataLoader, TensorDataset

_prepare_backend = PartialState._prepare_backend


def _cpu_backend(self, cpu=False, sagemaker_dp=False, backend=None):
    """Accelerate's backend choice, with a CPU process group where it would give none (module docstring)."""
    found = _prepare_backend(self, cpu, sagemaker_dp, backend)
    if found[0] is None and not torch.cuda.is_available():
        return _prepare_backend(self, True, sagemaker_dp, backend)
    return found


PartialState._prepare_backend = _cpu_backend


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 8, generator=g)
    data = TensorDataset(x, torch.sin(x[:, :4]) + 0.1 * torch.randn(48, 4, generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses, lrs, norms = [], [], []
    model.train()
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        # under DeepSpeed the engine clips (the config's gradient_clipping) and this returns its norm
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        lrs.append(scheduler.get_last_lr()[0])
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save({"losses": losses, "lrs": lrs, "grad_norms": norms,
                    "params": {k: v.float().clone() for k, v in state.items()},
                    "distributed_type": str(accelerator.distributed_type)}, os.path.join(args.out, "run.pt"))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
