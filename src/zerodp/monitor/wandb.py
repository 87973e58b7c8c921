"""`wandb`: the monitor's events logged to Weights & Biases (never a dependency of zerodp).

wandb.init(project, group, entity=team) once on rank 0, then one wandb.log({name: value}, step=samples)
per event, as DeepSpeed's WandbMonitor does.
"""

from __future__ import annotations

import importlib

from ..errors import ConfigError
from ..config.monitor import WandbConfig
from .event import Event


def check_wandb() -> None:
    """Refuse, on every rank, a wandb section that cannot be honoured."""
    try:
        importlib.import_module("wandb")
    except ImportError:
        raise ConfigError("wandb.enabled is true but the wandb package is missing; run `pip install wandb` (and "
                          "`wandb login`) or set wandb.enabled false") from None


class WandbMonitor:
    """One W&B run (rank 0 only builds one)."""

    def __init__(self, config: WandbConfig) -> None:
        check_wandb()
        self.wandb = importlib.import_module("wandb")
        self.run = self.wandb.init(project=config.project, group=config.group, entity=config.team)

    def write_events(self, events: list[Event]) -> None:
        for event in events:
            self.wandb.log({event.name: event.value}, step=event.step)

    def close(self) -> None:
        finish = getattr(self.run, "finish", None)
        if finish is not None:
            finish()
