"""The seams (src/zerodp/shard/seams.py) are checked, not prose: every implementation has every member of
its Protocol, and every method takes the Protocol's parameters (names, kinds, defaults' presence).
Implementations are taken from live engines at world size 1 (no process group), one per stage."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import zerodp
from zerodp.shard import seams

PROTOCOLS = (seams.ShardedUnit, seams.ShardingStrategy, seams.CheckpointOptimizer, seams.CheckpointEngine)


def _members(protocol) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


def _parameters(fn) -> list[tuple[str, inspect._ParameterKind, bool]]:
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return [(p.name, p.kind, p.default is inspect.Parameter.empty) for p in params]


def conformance_errors(obj, protocol) -> list[str]:
    """What `obj` lacks of `protocol`, or takes differently; empty when it conforms."""
    errors = []
    for name in sorted(_members(protocol)):
        if not hasattr(obj, name):
            errors.append(f"{type(obj).__name__} has no {name!r}")
            continue
        declared = vars(protocol).get(name)
        if callable(declared) and not isinstance(declared, property):
            got, want = _parameters(getattr(type(obj), name)), _parameters(declared)
            if got != want:
                errors.append(f"{type(obj).__name__}.{name} takes {got}, the Protocol {want}")
    return errors


def _engine(stage: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"zero_optimization": {"stage": stage}})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_implementation_conforms_to_its_protocol(stage):
    engine = _engine(stage)
    pairs = [(engine, seams.CheckpointEngine), (engine.sharding, seams.ShardingStrategy),
             (engine.optimizer, seams.CheckpointOptimizer)] + [(u, seams.ShardedUnit) for u in engine.units]
    for obj, protocol in pairs:
        assert isinstance(obj, protocol), f"{type(obj).__name__} is not a {protocol.__name__}"
        assert not conformance_errors(obj, protocol), conformance_errors(obj, protocol)
    engine.close()


def test_the_checker_sees_a_drifted_implementation():
    engine = _engine(3)

    class Drifted(type(engine.sharding)):
        def finish_micro_step(self, boundary, extra):  # a parameter the Protocol does not have
            return None

    drifted = object.__new__(Drifted)
    drifted.__dict__.update(engine.sharding.__dict__)
    assert conformance_errors(drifted, seams.ShardingStrategy) == [
        "Drifted.finish_micro_step takes [('boundary', <_ParameterKind.POSITIONAL_OR_KEYWORD: 1>, True), "
        "('extra', <_ParameterKind.POSITIONAL_OR_KEYWORD: 1>, True)], the Protocol "
        "[('boundary', <_ParameterKind.POSITIONAL_OR_KEYWORD: 1>, True)]"]
    del drifted.__dict__["units"]
    assert "Drifted has no 'units'" in conformance_errors(drifted, seams.ShardingStrategy)
    engine.close()


def _offloaded_engine(nvme_dir: str):
    """Stage 3, fp32, offload_param nvme with no cache: every sharded unit's parameter and gradient shards
    live in files between uses ([Note: a unit owns its residency] in stage3/flat_unit.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": 0, "buffer_count": 1}}
    return zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"zero_optimization": zero})


def _has_storage(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0


def test_an_offloaded_engine_conforms_and_its_units_hold_their_residency(tmp_path):
    engine = _offloaded_engine(str(tmp_path))
    pairs = [(engine, seams.CheckpointEngine), (engine.sharding, seams.ShardingStrategy),
             (engine.optimizer, seams.CheckpointOptimizer)] + [(u, seams.ShardedUnit) for u in engine.units]
    for obj, protocol in pairs:
        assert isinstance(obj, protocol) and not conformance_errors(obj, protocol), conformance_errors(obj, protocol)
    x = torch.randn(3, 4)
    engine.backward(engine(x).square().mean())
    assert all(u.param_offloaded and u.grad_offloaded for u in engine.units)
    for unit in engine.units:
        # max_in_cpu=0: nothing stays in memory outside a block; inside, the shard is there to read
        assert not _has_storage(unit.param_shard) and not _has_storage(unit.grad_shard)
        with unit.resident(), unit.grad_resident():
            assert _has_storage(unit.param_shard) and _has_storage(unit.grad_shard)
            read = torch.linalg.vector_norm(unit.grad_shard, dtype=torch.float32).double() ** 2
        assert read > 0 and torch.equal(unit.grad_square_norm(), read)  # kept from delivery, not read again
    with engine.sharding.all_resident():
        assert all(_has_storage(u.param_shard) for u in engine.units)
    footprint = engine.sharding.param_offload()
    shard_bytes = sum(u.param_shard.numel() * 4 for u in engine.units)
    assert footprint == seams.ParamOffload(0, shard_bytes, shard_bytes)  # fp32: grads as large as params
    engine.step()
    engine.close()
    assert list(tmp_path.iterdir()) == [], "the strategy's close() removes the offload files"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_without_offload_residency_is_free_and_norms_are_read(stage):
    engine = _engine(stage)
    engine.backward(engine(torch.randn(3, 4)).square().mean())
    assert engine.sharding.param_offload() is None
    for unit in engine.units:
        assert not unit.param_offloaded and not unit.grad_offloaded
        before = unit.param_shard.data_ptr()
        with unit.resident(dirty=True), unit.grad_resident():
            assert unit.param_shard.data_ptr() == before  # the same memory: nothing moved
        expected = torch.linalg.vector_norm(unit.grad_shard, dtype=torch.float32).double() ** 2
        assert expected > 0 and torch.equal(unit.grad_square_norm(), expected)
    engine.step()
    engine.close()


def test_the_checker_sees_a_drifted_unit():
    engine = _engine(3)
    unit = engine.units[0]

    class Drifted(type(unit)):
        def resident(self):  # lost `dirty`: a caller's write would not be written back
            return super().resident()

    drifted = object.__new__(Drifted)
    drifted.__dict__.update(unit.__dict__)
    assert conformance_errors(drifted, seams.ShardedUnit) == [
        "Drifted.resident takes [], the Protocol [('dirty', <_ParameterKind.POSITIONAL_OR_KEYWORD: 1>, False)]"]
    engine.close()
