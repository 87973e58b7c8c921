"""`deepspeed.moe.utils`: DeepSpeed's split of optimizer parameter groups into MoE and dense groups.

A parameter is an expert (MoE) parameter in DeepSpeed when it carries `allreduce = False` (set by
DeepSpeed's MoE layers). zerodp has no expert parallelism, so with no such parameter the groups come back
unchanged, as DeepSpeed returns them (a dict becomes a one-element list, a tuple a list); with one, the
call says that MoE is not supported.
"""

from __future__ import annotations

from typing import Any, Union


def is_moe_param(param) -> bool:
    """DeepSpeed's test: an expert parameter is marked `allreduce = False`."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(param_groups: Union[dict, tuple, list],
                                                         max_group_size: Union[int, float] = 178956971
                                                         ) -> list[dict[str, Any]]:
    """The groups as a list, unchanged when no parameter is an expert's (which is all zerodp trains)."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for group in param_groups:
        group["params"] = list(group["params"])  # DeepSpeed reads the params twice: a generator would empty
        if any(is_moe_param(p) for p in group["params"]):
            raise NotImplementedError("split_params_into_different_moe_groups_for_optimizer: the model has "
                                      "DeepSpeed MoE (expert) parameters; zerodp does not support MoE")
    return param_groups
