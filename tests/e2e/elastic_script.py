"""The README's own-script restart pattern ("Restarts in your own script"), as tests/e2e/elastic_nodes.py runs it
on two simulated nodes under torchrun's c10d rendezvous with --max_restarts 1:

    torchrun ... tests/e2e/elastic_script.py OUT STEPS

zerodp.initialize sets up the process group (of a restarted attempt too), the script continues from its newest
checkpoint, reads the batches of a step as a function of the step, saves a checkpoint every step and a final one.
The harness compares OUT/ckpt's final parameters with an uninterrupted run's, bitwise.
"""

import os
import sys
import time

import torch

import zerodp

out, total_steps = sys.argv[1], int(sys.argv[2])
ckpt = os.path.join(out, "ckpt")
GLOBAL_BATCH = 8


def batch_of(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the step's global batch: a function of the step only."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
engine = zerodp.initialize(model, optimizer, {"train_micro_batch_size_per_gpu": 2,
                                              "zero_optimization": {"stage": 2}})
start = engine.load_checkpoint(ckpt)["step"] if os.path.exists(os.path.join(ckpt, "latest")) else 0
with engine:
    for step in range(start, total_steps):
        x, y = batch_of(step, engine.rank, engine.world_size)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        engine.save_checkpoint(ckpt, client_state={"step": step + 1})
        time.sleep(0.3)  # leaves the harness time to kill a worker mid-run
print(f"rank {engine.rank}: started at step {start}, done {total_steps}", flush=True)
