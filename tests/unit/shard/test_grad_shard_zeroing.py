"""[Note: zeroing on first delivery] (shard/grads/grad_shard.py): after a step, a stage 2-3 in-memory gradient shard is
not zeroed by a pass of its own; its next delivery copies, and reading it before one gives zeros. Exactness is
the parity tests'; this checks the deferred zeroing itself, including a second micro-step's delivery adding."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import zerodp


def _engine(stage: int, gas: int = 1, weights=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if weights is not None:
        model.load_state_dict(weights)
    config = {"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": gas}
    return model, zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)


def _backward(engine, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    engine.backward(F.mse_loss(engine(x), torch.zeros(4, 4)))


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_grad_makes_no_pass_and_the_shard_reads_zeros(stage):
    _, engine = _engine(stage)
    _backward(engine, 0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()  # steps, then zero_grad
    shards = [u.grads for u in engine.units]
    assert all(g._zero_pending for g in shards)
    assert not any(e.name == "aten::zero_" and e.cpu_parent is None for e in prof.events()), \
        "zero_grad zeroed the shards itself"
    assert all(torch.count_nonzero(g.shard) == 0 for g in shards)  # read before a delivery: zeros
    assert not any(g._zero_pending for g in shards)
    engine.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_after_zero_grad_the_shard_holds_only_the_new_micro_steps(stage):
    """Two accumulation micro-steps after a step hold their own sum (the first delivery copies, the second adds),
    bitwise what a fresh engine at the same weights accumulates: nothing of the step before is left in."""
    _, engine = _engine(stage, gas=2)
    for seed in (0, 1):  # engine.step() after every micro-step, as DeepSpeed's loop: the second one steps
        _backward(engine, seed)
        engine.step()
    assert engine.global_step == 1
    weights = engine.full_state_dict(rank0_only=False)
    _, fresh = _engine(stage, gas=2, weights=weights)
    for e in (engine, fresh):
        _backward(e, 2)
        e.step()  # not a boundary: nothing stepped, nothing zeroed
        _backward(e, 3)
    for resumed, new in zip(engine.units, fresh.units):
        assert torch.count_nonzero(new.grads.shard) > 0
        assert torch.equal(resumed.grads.shard, new.grads.shard)
    engine.close()
    fresh.close()
