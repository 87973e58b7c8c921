"""`deepspeed.runtime`: the helpers scripts import from it (`utils`, `dataloader`, `zero`)."""

from . import activation_checkpointing, dataloader, utils, zero

__all__ = ["activation_checkpointing", "dataloader", "utils", "zero"]
