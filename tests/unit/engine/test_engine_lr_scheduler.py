"""`zerodp.initialize(..., lr_scheduler=...)`: the caller's schedule is a constructor argument of the engine and
a property the checkpoint reads (no attribute patched on after construction). One rank, no process group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerodp
from zerodp.checkpoint.save_load import LR_SCHEDULER_FILE
from zerodp.config import ConfigError
from zerodp.optimizers.client_schedule import ClientSchedule

CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _step(engine) -> None:
    engine.backward(F.mse_loss(engine(torch.ones(2, 3)), torch.zeros(2, 2)))
    engine.step()


def test_a_schedule_over_the_callers_optimizer_drives_the_engines_lr_and_is_saved(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = zerodp.initialize(model, opt, CONFIG, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s))
    assert isinstance(engine.lr_scheduler, ClientSchedule)
    _step(engine)
    _step(engine)
    assert engine.get_lr() == [0.25]  # the schedule's lr reached the optimizer that steps
    engine.save_checkpoint(tmp_path)
    assert len(list(tmp_path.rglob(LR_SCHEDULER_FILE))) == 1  # the checkpoint reads engine.lr_scheduler
    engine.lr_scheduler = None  # as Lightning's strategy sets it: the engine then steps no schedule
    _step(engine)
    assert engine.get_lr() == [0.25]
    engine.close()


def test_a_callable_is_built_on_the_engines_optimizer():
    built = []

    def make(optimizer):
        built.append(optimizer)
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)

    model = _model()
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), CONFIG, lr_scheduler=make)
    assert built == [engine.optimizer.optimizer] and not isinstance(engine.lr_scheduler, ClientSchedule)
    _step(engine)
    assert engine.get_lr() == pytest.approx([0.1])
    engine.close()


def test_a_schedule_and_a_scheduler_section_are_refused_together():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    config = {**CONFIG, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}
    with pytest.raises(ConfigError, match="lr_scheduler was passed and the config has a 'scheduler' section"):
        zerodp.initialize(model, opt, config, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))


def test_an_object_without_step_is_refused():
    model = _model()
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), CONFIG)
    with pytest.raises(TypeError, match="lr_scheduler must have a step"):
        engine.lr_scheduler = object()
    engine.close()
