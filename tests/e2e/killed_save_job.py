"""A torchrun job for tests/e2e/test_killed_save.py: save checkpoint "A", then start saving "B" and have
rank 1 die by SIGKILL in the middle of it, its shard file half written (argv: the checkpoint folder).

The kill is delivered by rank 1 to itself, right after its shard file of "B" is written and torn to
half its length, so it always lands between the start and the commit of the save (a kill timed from
outside would race a save that takes tens of milliseconds).
"""

import os
import signal
import sys

import torch
import torch.nn.functional as F

import zerodp
from zerodp.checkpoint import format as fmt

ckpt = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), {"zero_optimization": {"stage": 3}})
x = torch.randn(8, 256, generator=torch.Generator().manual_seed(engine.rank))
engine.backward(F.mse_loss(engine(x), torch.zeros(8, 256)))
engine.step()
engine.save_checkpoint(ckpt, tag="A")
state = engine.full_state_dict()
if engine.rank == 0:
    torch.save(state, os.path.join(ckpt, "A_params.pt"))

real_write = fmt.write_tensor_file


def write_then_die(path, tensors, metadata=None):
    digest = real_write(path, tensors, metadata)
    if engine.rank == 1 and fmt.TMP_PREFIX in str(path):
        with open(path, "r+b") as f:  # torn: as if the process died while writing
            f.truncate(os.path.getsize(path) // 2)
        print("rank 1: killing itself in the middle of saving B", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return digest


fmt.write_tensor_file = write_then_die
engine.backward(F.mse_loss(engine(x), torch.zeros(8, 256)))
engine.step()
engine.save_checkpoint(ckpt, tag="B")
print(f"rank {engine.rank}: saved B (the kill did not happen)", flush=True)
