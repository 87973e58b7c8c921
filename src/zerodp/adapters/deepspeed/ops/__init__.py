"""`deepspeed.ops`: the optimizer names scripts and Accelerate import (`adam`, `adagrad`, `lion`), built as torch
optimizers or zerodp's own with the same update.

Modules:
    adagrad/  `deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`, as torch's Adagrad (the same update).
    adam/     `deepspeed.ops.adam.FusedAdam` and `DeepSpeedCPUAdam`, as the torch optimizers with the same ...
    lion/     `deepspeed.ops.lion.DeepSpeedCPULion` and `FusedLion`, as zerodp's Lion (optim/lion.py: ...
"""

from . import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
