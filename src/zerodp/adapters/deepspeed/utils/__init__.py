"""`deepspeed.utils`: the logger, `log_dist`, `RepeatingLoader`, the safe getters of whole values, the stage-3 leaf
modules (`set_z3_leaf_modules`, z3_leaf.py) and `zero_to_fp32`.

Modules:
    logging.py          `deepspeed.utils.logging`: the `logger` scripts import and `log_dist` (log on the listed ranks ...
    tensor_fragment.py  `deepspeed.utils`' safe getters of whole (unsharded) values for one parameter. Collective: ...
    timer.py            `deepspeed.utils.timer.ThroughputTimer`: the engine's samples-per-second meter ...
    z3_leaf.py          `deepspeed.utils.set_z3_leaf_modules`: module classes whose instances stage 3 gathers whole, ...
    zero_to_fp32.py     `deepspeed.utils.zero_to_fp32`: the whole fp32 model from a sharded checkpoint, offline (no ...
"""

from ..runtime.dataloader import RepeatingLoader
from . import zero_to_fp32
from .logging import log_dist, logger
from .tensor_fragment import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
from .z3_leaf import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module

__all__ = ["logger", "log_dist", "RepeatingLoader", "safe_get_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state", "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules",
           "z3_leaf_module", "zero_to_fp32"]
