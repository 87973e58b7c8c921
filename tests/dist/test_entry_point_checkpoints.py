"""Every entry point saves and loads through the engine (`ZeroEngine.save_checkpoint` / `load_checkpoint`), so
each gets what the engine does around a checkpoint (shards written outside the optimizer synced, kept units
released, counters, scaler, schedule and RNG applied by the engine). Checked on the hardest case: bf16, stage 3,
both offloads on nvme with a user's sections (device and nvme_path) plus `max_in_cpu: 0` (with the
default, this small model's shards all fit in the gathers' working set and would never leave memory, so the
files would go untested), a WarmupLR schedule, 2 ranks.

For zerodp.initialize's engine and for the DeepSpeed adapter (`import zerodp.deepspeed as deepspeed`): train 2
steps, save, train 2 more; a fresh engine loads the checkpoint and trains the same 2 steps with bitwise the
same losses and learning rates. The adapter's `load_lr_scheduler_states=False` keeps the fresh engine's own
schedule state (DeepSpeed's meaning).

The two other entry points are checked where they run, in their own launches: ZeroTrainer under torchrun
(tests/hf/test_zero_trainer.py, test_resume_of_an_offloaded_bf16_stage3_run_equals_the_uninterrupted_run) and
`zerodp train --resume` (tests/e2e/test_train.py, test_offloaded_bf16_stage3_resume_equals_the_uninterrupted_run).
"""

from __future__ import annotations

import torch

import zerodp
import zerodp.deepspeed as deepspeed
from tests.dist.common import make_model, micro_batch

MICRO_BS = 2


def _config(nvme: str) -> dict:
    offload = {"device": "nvme", "nvme_path": nvme}
    return {"train_micro_batch_size_per_gpu": MICRO_BS, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 4}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 30, "stage3_unit_min_params": 200,
                                  "offload_param": {**offload, "max_in_cpu": 0},  # 0: every shard goes to its file
                                  "offload_optimizer": dict(offload)}}


def _build(kind: str, nvme: str):
    model = make_model()
    if kind == "deepspeed":
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(nvme))
        return engine
    cfg = _config(nvme)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    del cfg["optimizer"]
    return zerodp.initialize(model, optimizer, cfg)


def _steps(engine, first: int, count: int) -> list[tuple[float, float]]:
    """(loss, lr used) of optimizer steps [first, first + count) on this rank's micro-batches."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = []
    for step in range(first, first + count):
        x, y = micro_batch(step, 0, rank, world, MICRO_BS, 1)
        lr = engine.get_lr()[0]
        loss = torch.nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y)  # DeepSpeed casts no inputs
        engine.backward(loss)
        engine.step()
        out.append((loss.item(), lr))
    return out


def _close(kind: str, engine) -> None:
    # the pooled workers' process group is not zerodp's: closing leaves it up
    engine.destroy() if kind == "deepspeed" else engine.close()


def save_then_resume(kind: str, nvme: str, ckpt: str) -> dict:
    engine = _build(kind, nvme)
    _steps(engine, 0, 2)
    engine.save_checkpoint(ckpt, tag="t")
    uninterrupted = _steps(engine, 2, 2)
    _close(kind, engine)
    resumed_engine = _build(kind, nvme)
    resumed_engine.load_checkpoint(ckpt, tag="t")
    resumed = _steps(resumed_engine, 2, 2)
    _close(kind, resumed_engine)
    fresh_schedule = None
    if kind == "deepspeed":
        again = _build(kind, nvme)
        again.load_checkpoint(ckpt, tag="t", load_lr_scheduler_states=False)
        fresh_schedule = again.engine.lr_scheduler.state_dict()["last_batch_iteration"]
        _close(kind, again)
    return {"uninterrupted": uninterrupted, "resumed": resumed, "fresh_schedule_iteration": fresh_schedule}


def test_engine_and_deepspeed_adapter_resume_an_offloaded_bf16_stage3_run_exactly(dist_run, tmp_path):
    for kind in ("engine", "deepspeed"):
        (tmp_path / f"nvme-{kind}").mkdir()
        for result in dist_run(2, save_then_resume, kind, str(tmp_path / f"nvme-{kind}"), str(tmp_path / kind)):
            assert result["resumed"] == result["uninterrupted"], kind  # losses and lrs, bitwise
            assert result["uninterrupted"][0][1] > 0, "the schedule is past its first step"
            if kind == "deepspeed":  # the saved schedule is at iteration 1 (2 steps); a fresh one has not stepped
                assert result["fresh_schedule_iteration"] == -1, "load_lr_scheduler_states=False loaded the schedule"
