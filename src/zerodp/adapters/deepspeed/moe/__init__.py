"""`deepspeed.moe`: the parameter-group helper dense scripts call; DeepSpeed's MoE layers are refused.

Modules:
    layer.py  `deepspeed.moe.layer.MoE`: refused when constructed (zerodp has no expert parallelism).
    utils.py  `deepspeed.moe.utils`: DeepSpeed's split of optimizer parameter groups into MoE and dense ...
"""

from . import layer, utils

__all__ = ["layer", "utils"]
