"""`deepspeed.utils`: the logger, `log_dist`, `RepeatingLoader`, and the safe getters of whole values."""

from ..runtime.dataloader import RepeatingLoader
from .logging import log_dist, logger
from .tensor_fragment import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

__all__ = ["logger", "log_dist", "RepeatingLoader", "safe_get_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state", "set_z3_leaf_modules"]


def set_z3_leaf_modules(model, leaf_module_classes):
    """DeepSpeed's stage-3 leaf modules (gather a MoE block's parameters at once); refused in zerodp."""
    raise NotImplementedError("deepspeed.utils.set_z3_leaf_modules is not supported by zerodp: its stage-3 "
                              "units are set by zero_optimization.stage3_unit_min_params; remove the call")
