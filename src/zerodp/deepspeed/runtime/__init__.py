"""`deepspeed.runtime`: the helpers scripts import from it (`utils`, `dataloader`, `zero`, `lr_schedules`,
`activation_checkpointing`)."""

from . import activation_checkpointing, dataloader, lr_schedules, utils, zero

__all__ = ["activation_checkpointing", "dataloader", "lr_schedules", "utils", "zero"]
