"""One monitor event: a named scalar at a sample count, as DeepSpeed's monitors write them.

Names are DeepSpeed's (`Train/Samples/train_loss`, `Train/Samples/lr`, `Train/Samples/loss_scale`)
plus `Train/Samples/grad_norm`; the x-axis `step` counts training samples seen, DeepSpeed's
`global_samples` (optimizer steps x train_batch_size), so curves line up with DeepSpeed's.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

TRAIN_LOSS = "Train/Samples/train_loss"
LR = "Train/Samples/lr"
LOSS_SCALE = "Train/Samples/loss_scale"
GRAD_NORM = "Train/Samples/grad_norm"


class Event(NamedTuple):
    name: str
    value: float
    step: int  # samples seen when the value was taken (DeepSpeed's global_samples)


class EventWriter(Protocol):
    """What csv_monitor, tensorboard and wandb have in common: rank 0 writes a step's events."""

    def write_events(self, events: list[Event]) -> None: ...

    def close(self) -> None: ...
