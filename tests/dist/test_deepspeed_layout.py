"""Checkpoints zerodp writes in DeepSpeed's ZeRO layout (issue 40, part 2), checked without DeepSpeed:

1. the zero_to_fp32.py zerodp puts beside `latest` (its own code: torch only, no zerodp or DeepSpeed import, following
   the layout DeepSpeed's zero_to_fp32.py documents) reads the fp32 weights zerodp saved, exactly;
2. the DeepSpeed files alone (zerodp's own files deleted) resume exactly as zerodp's own format does: the same losses,
   lrs, parameters and counters over 3 more steps. So what was written is the whole training state (masters, Adam's
   moments and step, schedule, loss scaler, client state), in the layout zerodp's reader of DeepSpeed's fixtures
   (tests/dist/test_deepspeed_resume.py) reads from real DeepSpeed.
Real DeepSpeed reading these files (get_fp32_state_dict_from_zero_checkpoint, load_checkpoint and training on) is
in the bench environment: bench/deepspeed_reads_zerodp.py, results in bench/results/deepspeed_reads_zerodp.md.
Tolerance: exact (the same arithmetic resumes from the same fp32 values), rtol 1e-6 for summation-order noise.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerodp.deepspeed as deepspeed
from tests.dist import harness
from tests.dist.common import make_model, micro_batch, param_groups
from tests.fixtures.deepspeed_ckpt.loop import GAS, LR, MICRO_BS, dtype_of, layout_config, train

ZERODP_FILES = ("meta.json", "shard-", "rng-", "model_states.safetensors", "client_state.pt", "lr_scheduler.pt")


def _train(engine, first: int, steps: int, dtype) -> tuple[list, list]:
    rank, world = dist.get_rank(), dist.get_world_size()
    return train(engine, first, steps, lambda step, micro: micro_batch(step, micro, rank, world, MICRO_BS, GAS), dtype)


def _engine(stage: int, precision: str, seed: int):
    model = make_model(seed)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model, 1e-2), lr=LR),
                                      config=layout_config(stage, precision))
    return engine


def _after(engine, losses, lrs) -> dict:
    return {"losses": losses, "lrs": lrs, "params": engine.full_state_dict(rank0_only=False),
            "counters": (engine.global_steps, engine.skipped_steps, engine.engine.scaler.state_dict())}


def save_and_continue(stage: int, precision: str, save_dir: str) -> dict:
    """Train 3 steps, save (zerodp's format and DeepSpeed's layout), train 3 more: the continuation to match."""
    engine = _engine(stage, precision, seed=0)
    _train(engine, 0, 3, dtype_of(precision))
    saved = engine.full_state_dict(rank0_only=False)
    engine.save_checkpoint(save_dir, client_state={"epoch": 7})
    out = {"saved": saved, **_after(engine, *_train(engine, 3, 3, dtype_of(precision)))}
    engine.destroy()
    return out


def resume(stage: int, precision: str, load_dir: str) -> dict:
    engine = _engine(stage, precision, seed=123)
    _, client = engine.load_checkpoint(load_dir)
    out = {"client": client.get("epoch"), **_after(engine, *_train(engine, 3, 3, dtype_of(precision)))}
    engine.destroy()
    return out


def _zero_to_fp32(path: Path):
    spec = importlib.util.spec_from_file_location("zero_to_fp32_beside_latest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16"), (3, "bf16"),
                                             (2, "fp16")])
def test_deepspeed_layout_is_read_by_zero_to_fp32_and_resumes_exactly(tmp_path, stage, precision):
    ckpt = tmp_path / "ckpt"
    first = harness.run(2, save_and_continue, stage, precision, str(ckpt))[0]

    # 1. the script beside `latest` reads DeepSpeed's files only (it never opens zerodp's)
    script = ckpt / "zero_to_fp32.py"
    assert script.is_file() and "import zerodp" not in script.read_text()
    tag = ckpt / "global_step3"
    assert sorted(p.name for p in tag.glob("*optim_states.pt")) == [
        f"{'bf16_' if precision == 'bf16' else ''}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    weights = _zero_to_fp32(script).get_fp32_state_dict(ckpt)
    assert weights.keys() == first["saved"].keys()
    for key, value in first["saved"].items():
        torch.testing.assert_close(weights[key], value.float(), rtol=0, atol=0, msg=lambda m: f"{key}: {m}")

    # 2. DeepSpeed's files alone resume as zerodp's own format does
    ds_only = tmp_path / "ds_only"
    shutil.copytree(ckpt, ds_only, ignore=lambda d, names: [n for n in names if n.startswith(ZERODP_FILES)])
    assert not (ds_only / "global_step3" / "meta.json").exists()
    for got in harness.run(2, resume, stage, precision, str(ds_only)):
        assert got["client"] == 7
        assert got["lrs"] == first["lrs"] and got["counters"] == first["counters"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(first["losses"]), rtol=1e-6, atol=0)
        for key, value in first["params"].items():
            torch.testing.assert_close(got["params"][key], value, rtol=1e-6, atol=0, msg=lambda m: f"{key}: {m}")
