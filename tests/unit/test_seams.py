"""The seams (src/zerodp/seams.py) are checked, not prose: every implementation has every member of
its Protocol, and every method takes the Protocol's parameters (names, kinds, defaults' presence).
Implementations are taken from live engines at world size 1 (no process group), one per stage."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import zerodp
from zerodp import seams

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
