"""A zerodp engine from a VISSL config file: VISSL's optimizer and param groups, and its lr schedule.

    setup = zerodp.config_vissl.load_vissl("swav_8node_resnet.yaml")   # or a list: base, then overlays
    engine, schedule = zerodp.integrations.vissl.initialize(setup, model, steps_per_epoch=len(loader))
    ... engine.backward(loss); engine.step(); schedule.step()          # per optimizer step
"""

from __future__ import annotations

from torch import nn

from ..config.vissl import load_vissl
from ..config.vissl_setup import VisslSetup
from ..engine import initialize as initialize_engine
from ..optim.vissl_params import vissl_optimizer

__all__ = ["initialize", "load_vissl"]


def initialize(setup: VisslSetup, model: nn.Module, steps_per_epoch: int, process_group=None):
    """`zerodp.initialize` with a VISSL setup; returns (engine, lr schedule to step after each engine step)."""
    engine = initialize_engine(model, vissl_optimizer(setup, model), setup.zero_config, process_group)
    return engine, setup.lr_schedule(engine.optimizer, steps_per_epoch)
