"""`deepspeed.runtime`: the helpers scripts import from it (`utils`, `dataloader`, `zero`)."""

from . import dataloader, utils, zero

__all__ = ["dataloader", "utils", "zero"]
