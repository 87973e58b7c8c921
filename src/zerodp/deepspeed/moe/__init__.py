"""`deepspeed.moe`: the parameter-group helper dense scripts call; DeepSpeed's MoE layers are refused."""

from . import layer, utils

__all__ = ["layer", "utils"]
