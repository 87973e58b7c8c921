"""A training script written as the README's quick start shows (no close(), no destroy): the
teardown check (`teardown_check.py`) runs it many times and requires exit code 0 from every rank.

    torchrun --nproc_per_node 2 tests/e2e/readme_script.py [STAGE]
"""

import sys

import torch

import zerodp

stage = int(sys.argv[1]) if len(sys.argv) > 1 else 3
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine = zerodp.initialize(model, optimizer, {"train_micro_batch_size_per_gpu": 4,
                                              "zero_optimization": {"stage": stage,
                                                                    "stage3_unit_min_params": 64}})
for step in range(3):
    x = torch.randn(4, 16)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
print(f"rank {engine.rank}: done {engine.global_step} steps", flush=True)
