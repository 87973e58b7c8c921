"""`deepspeed.utils`: the logger, `log_dist`, `RepeatingLoader`, the safe getters of whole values, the stage-3 leaf
modules (`set_z3_leaf_modules`, z3_leaf.py) and `zero_to_fp32`."""

from ..runtime.dataloader import RepeatingLoader
from . import zero_to_fp32
from .logging import log_dist, logger
from .tensor_fragment import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
from .z3_leaf import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module

__all__ = ["logger", "log_dist", "RepeatingLoader", "safe_get_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state", "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules",
           "z3_leaf_module", "zero_to_fp32"]
