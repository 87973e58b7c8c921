"""`deepspeed.ops`: the optimizer names scripts and Accelerate import (`adam`, `adagrad`, `lion`), built as torch
optimizers or zerodp's own with the same update."""

from . import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
