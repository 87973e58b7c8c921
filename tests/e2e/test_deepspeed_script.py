"""Acceptance: a DeepSpeed training script runs under torchrun on 2 ranks after changing only its import
line (tests/e2e/deepspeed_script/train_ds.py), and its losses equal plain PyTorch running the same
optimizer (DeepSpeed's "Adam" = decoupled weight decay) and schedule (WarmupDecayLR) on the global batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT_DIR = Path(__file__).resolve().parent / "deepspeed_script"
sys.path.insert(0, str(SCRIPT_DIR))
import train_ds  # noqa: E402  (the script's own model and data, for the reference run)

from tests.oracle import train_reference  # noqa: E402

LR, WD, BETAS, EPS = 0.02, 0.1, (0.9, 0.95), 1e-8
WARMUP, TOTAL = 2, 6


def ds_config(stage: int) -> dict:
    return {
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 100,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": LR, "warmup_type":
                                                          "linear", "warmup_num_steps": WARMUP,
                                                          "total_num_steps": TOTAL}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "allgather_partitions": True, "overlap_comm": True,
                              "reduce_bucket_size": "auto", "stage3_gather_16bit_weights_on_model_save": True,
                              "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 100},
        "wall_clock_breakdown": False,
    }


def schedule(t: int) -> float:
    """WarmupDecayLR's closed form at iteration t (-1 before the first step)."""
    if t < 0:
        return 0.0
    gamma = t / WARMUP if t < WARMUP else max(0.0, (TOTAL - t) / max(1, TOTAL - WARMUP))
    return LR * gamma


def reference(world: int, micro: int, gas: int, steps: int):
    """The oracle (tests/oracle.py): plain PyTorch, one process, the global batch of each step (the ranks'
    DistributedSampler shards), the lr of the schedule set before each step."""
    model, data = train_ds.make_model(), train_ds.make_data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()  # DistributedSampler
    shards = [perm[r::world] for r in range(world)]
    lrs = []

    def set_lr(model, opt, step: int) -> None:
        for group in opt.param_groups:
            group["lr"] = schedule(step - 1)
        lrs.append(opt.param_groups[0]["lr"])

    def step_loss(model, step: int) -> torch.Tensor:
        idx = [i for r in range(world) for i in shards[r][step * gas * micro:(step + 1) * gas * micro]]
        x, y = data[idx]
        return torch.nn.functional.mse_loss(model(x), y)

    ref = train_reference(model, opt, steps, step_loss, clip=1.0, before_step=set_lr)
    return ref.losses, lrs, model


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_script_under_torchrun_equals_plain_pytorch(tmp_path, stage):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(ds_config(stage)))
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--standalone", str(SCRIPT_DIR / "train_ds.py"), "--deepspeed",
                           "--deepspeed_config", str(config), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["world_size"], result["train_batch_size"], result["stage"]) == (2, 8, stage)

    losses, lrs, model = reference(world=2, micro=2, gas=2, steps=TOTAL)
    assert result["lrs"] == pytest.approx(lrs, abs=1e-12)
    assert result["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert result["resumed"] == pytest.approx(result["losses"][3:], rel=1e-6, abs=1e-7)  # exact resume
    assert result["resumed_lrs"] == pytest.approx(result["lrs"][3:], abs=1e-12)
    assert result["path"].endswith("global_step3")

    torch.testing.assert_close(torch.tensor(result["weight0"]), model[0].weight.detach(), rtol=1e-5, atol=1e-6)
    # save_16bit_model: safetensors that the plain model loads strictly (fp32 run: the compute dtype is fp32)
    from safetensors.torch import load_file

    plain = train_ds.make_model()
    plain.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    for got, want in zip(plain.parameters(), model.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    # stage3_gather_16bit_weights_on_model_save: the checkpoint carries the 16-bit weights too
    assert (tmp_path / "ckpt" / "global_step3" / "model.safetensors").exists()
