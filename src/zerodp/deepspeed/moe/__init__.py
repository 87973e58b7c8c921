"""`deepspeed.moe`: DeepSpeed's MoE layer (layer.py) and its parameter helpers (utils.py), on zerodp.moe."""

from . import layer, utils

__all__ = ["layer", "utils"]
