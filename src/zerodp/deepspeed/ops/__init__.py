"""`deepspeed.ops`: the optimizer names scripts import (`deepspeed.ops.adam`), built as torch optimizers."""

from . import adam

__all__ = ["adam"]
