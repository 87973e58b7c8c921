"""`deepspeed.moe.utils`: DeepSpeed's test for an expert parameter and its split of optimizer parameter groups.

An expert parameter is one of a `deepspeed.moe.layer.MoE` (or `zerodp.moe.MoE`) layer's experts, known from
the layers' registry (zerodp.moe.layer.is_expert_parameter: no attribute is set on the parameter), or one a
script marked DeepSpeed's way, `param.allreduce = False` (with `param.group_name`).
The split gives DeepSpeed's groups: each group's expert parameters move to new groups (same settings,
`moe: True`, `name: ep_size_<P>`), at most `max_group_size` elements each; zerodp needs no such split (its
engine finds the experts itself) but takes the groups as they come.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Union

from ....moe.layer import expert_ep_size, is_expert_parameter


def is_moe_param(param) -> bool:
    """DeepSpeed's test: a parameter of a MoE layer's experts."""
    return is_expert_parameter(param) or (hasattr(param, "allreduce") and not param.allreduce)


def _group_name(param) -> str:
    return f"ep_size_{expert_ep_size(param)}" if is_expert_parameter(param) else param.group_name


def split_params_into_different_moe_groups_for_optimizer(param_groups: Union[dict, tuple, list],
                                                         max_group_size: Union[int, float] = 178956971
                                                         ) -> list[dict[str, Any]]:
    """DeepSpeed's split (module docstring); a dict becomes a one-element list, a tuple a list."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for group in param_groups:
        group["params"] = list(group["params"])  # read twice below: a generator would empty
    names = sorted({_group_name(p) for g in param_groups for p in g["params"] if is_moe_param(p)})
    if not names:
        return param_groups
    for group in param_groups:
        if "name" not in group:
            raise ValueError("split_params_into_different_moe_groups_for_optimizer: every param group needs a "
                             "'name' key (DeepSpeed reads it), e.g. {'params': ..., 'name': 'parameters'}")
    moe_groups: dict = defaultdict(dict)
    for group in param_groups:
        for name in names:
            moe_groups[group["name"]][name] = {**group, "name": name, "moe": True, "params": []}
    for group in param_groups:
        dense = []
        for p in group["params"]:
            if is_moe_param(p):
                moe_groups[group["name"]][_group_name(p)]["params"].append(p)
            else:
                dense.append(p)
        group["params"] = dense
    for by_name in moe_groups.values():
        for group in by_name.values():
            if max_group_size is None:
                param_groups.append(group)
                continue
            pieces, current, numel = [], [], 0
            for p in group["params"]:
                if current and numel + p.numel() > max_group_size:
                    pieces.append(current)
                    current, numel = [], 0
                current.append(p)
                numel += p.numel()
            if current:
                pieces.append(current)
            param_groups.extend({**group, "params": piece} for piece in pieces)
    return param_groups
