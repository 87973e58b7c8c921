"""The gradient-to-update path composed once (issue 43 part 2; engine/grad_path.py, optim/step_path.py):
a backward stays inside the gradient machinery (the optimizer takes no part in it), ZeRO-Offload's host copy is
the gradient shards' destination given once by the engine, and the step's path is chosen at construction."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerodp
from tests.dist.common import global_batch, make_model, make_optimizer
from tools.trace_backward import trace
from zerodp.optim.step_path import BoundGradients, TransientGradients


def test_a_stage2_backward_crosses_few_modules_and_no_optimizer():
    """The issue's bound, measured by tools/trace_backward.py (16 modules in 8 packages before): a regression
    here means the backward grew another detour (an observer, a callback up, a per-round call into flat/)."""
    counts = trace(2)
    modules, packages = counts["modules"], counts["packages"]
    assert len(modules) <= 10 and len(packages) <= 5, sorted(modules)
    assert not [m for m in modules if m.startswith(("zerodp.optim", "zerodp.shard.flat", "zerodp.monitor"))]
    assert "zerodp.shard.grads.grad_shard" in modules  # the trace saw the gradient machine at all


def test_host_staging_is_the_destination_and_the_backward_never_calls_the_optimizer():
    """Forced ZeRO-Offload placement on the CPU (as tests/unit/test_placement.py): the copies are still made during
    the backward, by the shards' destination, while no optimizer module runs."""
    counts = trace(2, host_staging=True)
    modules = counts["modules"]
    assert "zerodp.optim.grad_staging" in modules  # the host copies queued at the deliveries
    assert not [m for m in modules if m in ("zerodp.optim.optimizer", "zerodp.optim.step_plan")]


def _engine(cfg: dict):
    model = make_model()
    return zerodp.initialize(model, make_optimizer("adamw", model), cfg)


def test_the_engine_gives_each_shard_its_destination_once(monkeypatch):
    import dataclasses

    import zerodp.engine.zero_engine as engine_module
    from zerodp.offload.placement import HOST, Home

    original = engine_module.placement_of
    monkeypatch.setattr(engine_module, "placement_of", lambda config, device: dataclasses.replace(
        original(config, device), masters_are_shards=False, grad_staging=Home(HOST, torch.float32),
        param_staging=Home(HOST, torch.float32)))
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with _engine(cfg) as engine:
        assert engine.grad_staging is not None and engine.optimizer.plan.staging is engine.grad_staging
        assert all(unit.grads.destination is not None for unit in engine.units)
        with pytest.raises(AssertionError, match="chosen once"):
            engine.units[0].grads.deliver_to(engine.grad_staging.destination(0))
        x, y = global_batch(0, 4)
        engine.backward(F.mse_loss(engine(x), y))
        assert engine.grad_staging.staged_copies == len(engine.units)  # one copy per shard, at its delivery
        engine.step()


def test_without_offload_no_shard_has_a_destination():
    with _engine({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}) as engine:
        assert engine.grad_staging is None and engine.optimizer.plan.staging is None
        assert all(unit.grads.destination is None for unit in engine.units)


@pytest.mark.parametrize("cfg,path", [
    ({"bf16": {"enabled": True}}, TransientGradients),   # 16-bit shards, fp32 masters: windowed copies
    ({}, BoundGradients),                                 # fp32: the shards are the gradients
    ({"fp16": {"enabled": True}}, BoundGradients),        # a loss scale that may change: never transient
])
def test_the_step_path_is_chosen_at_construction(cfg, path):
    with _engine({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}, **cfg}) as engine:
        assert type(engine.optimizer.path) is path
