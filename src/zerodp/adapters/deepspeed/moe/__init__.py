"""`deepspeed.moe`: DeepSpeed's MoE layer (layer.py) and its parameter helpers (utils.py), on zerodp.moe.

Modules:
    layer.py  `deepspeed.moe.layer.MoE`: DeepSpeed's mixture-of-experts layer on zerodp's (zerodp.moe, ...
    utils.py  `deepspeed.moe.utils`: DeepSpeed's test for an expert parameter and its split of optimizer ...
"""

from . import layer, utils

__all__ = ["layer", "utils"]
