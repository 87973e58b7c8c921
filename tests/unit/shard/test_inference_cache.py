"""Stage 3's inference cache at world size 1 (no process group): which units stay gathered between
eval/no-grad forwards, the eviction order ([Note: eviction order] in stage3/inference_cache.py), the
budget, and the asserted residency transitions."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerodp
from zerodp import comm
from zerodp.shard.stage3.inference_cache import Residency

WIDTH = 8
UNIT_NUMEL = WIDTH * WIDTH + WIDTH  # one Linear: weight and bias in one flat unit


class Branches(nn.Module):
    """Two paths of four Linear units each; a forward takes one of them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.b = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor, branch: str = "a") -> torch.Tensor:
        for layer in getattr(self, branch):
            x = torch.tanh(layer(x))
        return x


def engine_for(model: nn.Module, **zero) -> zerodp.ZeroEngine:
    config = {"zero_optimization": {"stage": 3, "stage3_unit_modules": ["Linear"], "stage3_unit_min_params": 0,
                                    "stage3_param_persistence_threshold": 0, **zero}}
    return zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)


def kept_names(engine) -> list[str]:
    return [f.module_name for f in engine.sharding.schedule.inference.kept]


def evaluate(engine, branch: str = "a") -> int:
    """One eval/no-grad forward; returns the elements it all-gathered."""
    engine.eval()
    with torch.no_grad(), comm.record() as log:
        engine(torch.ones(2, WIDTH), branch)
    return sum(r.numel for r in log.of("all_gather", "param"))


def test_budget_holding_the_model_gathers_only_once():
    engine = engine_for(Branches())
    assert evaluate(engine) == 4 * UNIT_NUMEL
    assert evaluate(engine) == 0 and evaluate(engine) == 0
    assert kept_names(engine) == ["a.0", "a.1", "a.2", "a.3"]
    assert all(f.residency is Residency.KEPT for f in engine.sharding.flats if f.module_name.startswith("a"))


def test_a_cyclic_scan_keeps_the_first_units_that_fit():
    # room for two units: plain LRU would evict a.0 for a.2, a.1 for a.3, then a.2 for a.0 ... and keep
    # nothing that the next pass uses first; the guard keeps a.0 and a.1 for good
    engine = engine_for(Branches(), stage3_max_live_parameters=2 * UNIT_NUMEL)
    assert evaluate(engine) == 4 * UNIT_NUMEL
    for _ in range(3):
        assert kept_names(engine) == ["a.0", "a.1"]
        assert evaluate(engine) == 2 * UNIT_NUMEL  # only a.2 and a.3 are gathered again


def test_units_no_longer_used_are_evicted_least_recently_used_first():
    engine = engine_for(Branches(), stage3_max_live_parameters=4 * UNIT_NUMEL)
    evaluate(engine, "a")
    assert kept_names(engine) == ["a.0", "a.1", "a.2", "a.3"]
    assert evaluate(engine, "b") == 4 * UNIT_NUMEL  # the other path: a's units are stale, evicted in LRU order
    assert kept_names(engine) == ["b.0", "b.1", "b.2", "b.3"]
    assert evaluate(engine, "b") == 0


def test_fraction_zero_keeps_nothing_and_training_is_untouched():
    engine = engine_for(Branches(), stage3_inference_memory_fraction=0.0)
    assert evaluate(engine) == evaluate(engine) == 4 * UNIT_NUMEL
    assert engine.sharding.live_numel == 0
    cached = engine_for(Branches())
    cached.train()
    with comm.record() as log:  # a training forward (grad enabled) keeps nothing
        cached(torch.ones(2, WIDTH)).sum()
    assert kept_names(cached) == [] and sum(r.numel for r in log.of("all_gather", "param")) == 4 * UNIT_NUMEL


def test_a_grad_enabled_eval_forward_releases_and_keeps_nothing():
    engine = engine_for(Branches())
    evaluate(engine)
    with comm.record() as log:
        engine(torch.ones(2, WIDTH))  # eval mode, grad enabled: a backward may follow
    assert kept_names(engine) == [] and engine.sharding.live_numel == 0
    assert sum(r.numel for r in log.of("all_gather", "param")) == 4 * UNIT_NUMEL


def test_gathered_parameters_releases_kept_units_so_read_only_writes_are_discarded():
    model = Branches()
    engine = engine_for(model)
    before = evaluate_output = None
    engine.eval()
    with torch.no_grad():
        before = engine(torch.ones(2, WIDTH))
        with zerodp.gathered_parameters(model.a[0].weight):
            model.a[0].weight.add_(1.0)  # read-only block: documented as discarded
        evaluate_output = engine(torch.ones(2, WIDTH))
    assert torch.equal(before, evaluate_output)


def test_residency_transitions_are_asserted():
    engine = engine_for(Branches())
    evaluate(engine)
    flat = engine.sharding.schedule.inference.kept[0]
    with pytest.raises(AssertionError, match="already kept"):
        flat.keep()
    engine.train()
    assert flat.residency is Residency.TRANSIENT and engine.sharding.live_numel == 0
    with pytest.raises(AssertionError, match="not kept"):
        flat.unkeep()
    with pytest.raises(AssertionError, match="not in use"):
        flat.keep()  # sharded, nobody holds it: nothing to keep


def test_inference_mode_forwards_keep_units_and_training_follows():
    model = Branches()
    engine = engine_for(model)
    engine.eval()
    with torch.inference_mode():
        first = engine(torch.ones(2, WIDTH))
        with comm.record() as log:
            again = engine(torch.ones(2, WIDTH))
    assert torch.equal(first, again) and not log.of("all_gather", "param")
    engine.train()  # training after inference_mode forwards: released, gathered afresh, gradients flow
    loss = engine(torch.ones(2, WIDTH)).pow(2).sum()
    engine.backward(loss)
    engine.step()
    assert engine.sharding.live_numel == 0
