"""`deepspeed.runtime`: the helpers scripts import from it (`utils`, `dataloader`)."""

from . import dataloader, utils

__all__ = ["dataloader", "utils"]
