"""docs/troubleshooting.md: "a rank killed during a save loses nothing but that save". A real SIGKILL of rank 1 in the
middle of a real save under torchrun (tests/e2e/killed_save_job.py: its shard file of the new
checkpoint torn to half its length): `latest` still names the previous checkpoint, which loads in a
fresh engine at another world size with the parameters it was saved with, and the next save in the
same folder succeeds and clears the dead save's leftovers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerodp
from zerodp.checkpoint import format as fmt

JOB = Path(__file__).with_name("killed_save_job.py")


@pytest.mark.timeout(240)
def test_rank_killed_in_the_middle_of_a_save_loses_nothing_else(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(JOB), str(ckpt)], capture_output=True, text=True, timeout=200, env=env)
    assert "killing itself in the middle of saving B" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "saved B" not in proc.stdout
    assert proc.returncode != 0
    listing = sorted(p.name for p in ckpt.iterdir())
    assert f"{fmt.TMP_PREFIX}B" in listing, f"the kill did not land inside the save: {listing}"
    assert "B" not in listing and (ckpt / "latest").read_text().strip() == "A", listing

    # A fresh engine, at world size 1 (the checkpoint was written by 2 ranks), loads A exactly.
    saved = torch.load(ckpt / "A_params.pt")
    torch.manual_seed(1)  # other initial weights: the load must replace them
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    with zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                           {"zero_optimization": {"stage": 2}}) as engine:
        engine.load_checkpoint(ckpt)
        assert engine.global_step == 1
        for name, p in model.state_dict().items():
            assert torch.equal(p, saved[name]), name
        engine.save_checkpoint(ckpt, tag="C")  # the folder is usable: the dead save's leftovers are cleared
    assert sorted(p.name for p in ckpt.iterdir()) == ["A", "A_params.pt", "C", "latest"]
