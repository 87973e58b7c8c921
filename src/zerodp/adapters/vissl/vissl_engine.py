"""A zerodp engine from a VISSL config file: VISSL's optimizer and param groups, and its lr schedule.

    setup = zerodp.config.vissl.load_vissl("swav_8node_resnet.yaml")   # or a list: base, then overlays
    engine, schedule = zerodp.adapters.vissl.vissl_engine.initialize(setup, model, steps_per_epoch=len(loader))
    ... engine.backward(loss); engine.step(); schedule.step()          # per optimizer step
"""

from __future__ import annotations

from torch import nn

from ... import ZeroEngine
from ... import initialize as zerodp_initialize
from .vissl_optimizer import VisslLRScheduler, vissl_lr_scheduler, vissl_optimizer
from ...config.vissl import VisslSetup, load_vissl

__all__ = ["initialize", "load_vissl"]


def initialize(setup: VisslSetup, model: nn.Module, steps_per_epoch: int,
               process_group=None) -> tuple[ZeroEngine, VisslLRScheduler]:
    """`zerodp.initialize` with a VISSL setup; returns (engine, lr schedule to step after each engine step).

    The one entry for a VISSL file (`zerodp.initialize` and `load_config` read only zerodp's own,
    DeepSpeed-style config): the setup is translated here, before the config is loaded. A VISSL lr schedule
    is a function of the fraction of training done, so it needs the steps per epoch, which no config file
    holds, and it steps the param groups of the engine's optimizer, which exist only once the engine does.
    This function only translates: the engine is built by the one `zerodp.initialize`.
    """
    engine = zerodp_initialize(model, vissl_optimizer(setup, model), setup.zero_config, process_group)
    return engine, vissl_lr_scheduler(setup, engine.optimizer, steps_per_epoch)
