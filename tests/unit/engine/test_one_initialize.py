"""One `initialize`: every entry point (zerodp's own, DeepSpeed's dialect, VISSL's) builds its engine through
`zerodp.initialize`, the only code that constructs a `ZeroEngine`; the dialects only translate arguments.
In process, one rank, no process group."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import zerodp
import zerodp.deepspeed as deepspeed
import zerodp.adapters.vissl.vissl_engine
from zerodp.config import ConfigError
from zerodp.config.vissl import load_vissl

SRC = Path(__file__).resolve().parents[3] / "src" / "zerodp"


def _constructions_of(name: str) -> list[str]:
    """'module:function' for every call `name(...)` in src/zerodp, by where it sits."""
    found = set()

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = node.name
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name:
            found.add(f"{path.relative_to(SRC)}:{where}")
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    for path in SRC.rglob("*.py"):
        if name in (text := path.read_text()):
            visit(ast.parse(text), "<module>")
    return sorted(found)


def test_only_zerodp_initialize_constructs_an_engine():
    assert _constructions_of("ZeroEngine") == ["engine/zero_engine.py:initialize"]


def test_the_checker_finds_a_construction():
    assert _constructions_of("DeepSpeedEngine") == ["adapters/deepspeed/__init__.py:initialize"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def test_deepspeed_initialize_is_zerodp_initialize_with_deepspeeds_input_casting():
    """bf16: DeepSpeed does not cast inputs, zerodp's own engine does; both engines are the core one."""
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    model = _model()
    ds_engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    own = zerodp.initialize(_model(), None, config)
    assert type(ds_engine.engine) is type(own) is zerodp.ZeroEngine
    assert ds_engine.engine.cast_inputs is False and own.cast_inputs is True
    # DeepSpeed's optimizer surface (zero_grad, state: deepspeed/zero_optimizer.py) over the core engine's optimizer
    assert optimizer is ds_engine.optimizer and optimizer.optimizer is ds_engine.engine.optimizer.optimizer
    ds_engine.engine.close()
    own.close()


def test_deepspeed_refuses_dist_init_required_false_without_a_group_under_torchrun(monkeypatch):
    """DeepSpeed refuses it too; zerodp.initialize would otherwise create the group the caller declined."""
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="dist_init_required=False.*init_process_group first"):
        deepspeed.initialize(model=_model(), config={"train_micro_batch_size_per_gpu": 1},
                             dist_init_required=False)
    assert not torch.distributed.is_initialized()


def test_vissl_initialize_is_zerodp_initialize_plus_the_schedule():
    spec = {"OPTIMIZER": {"name": "sgd", "num_epochs": 2, "param_schedulers": {"lr": {
        "name": "linear", "start_value": 0.4, "end_value": 0.0, "update_interval": "step"}}}}
    engine, schedule = zerodp.adapters.vissl.vissl_engine.initialize(load_vissl(spec, quiet=True), _model(), steps_per_epoch=2)
    assert type(engine) is zerodp.ZeroEngine
    assert schedule.param_groups == list(engine.optimizer.param_groups)  # it steps the engine's optimizer
    assert [schedule.lr_at(s) for s in range(4)] == pytest.approx([0.4, 0.3, 0.2, 0.1])
    engine.close()
