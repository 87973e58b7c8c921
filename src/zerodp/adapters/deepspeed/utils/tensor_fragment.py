"""`deepspeed.utils`' safe getters of whole (unsharded) values for one parameter. Collective: every
rank must call them for the same parameter (they gather the shards: checkpoint/param_values.py)."""

from __future__ import annotations

from typing import Optional

import torch

from ....checkpoint import GRAD, MASTER, whole_param_value
from ....checkpoint.deepspeed_pickle import fragment_address


def _engine_of(param: torch.nn.Parameter):
    from ..engine import ENGINE_OF_PARAM

    wrapper = ENGINE_OF_PARAM.get(id(param))
    if wrapper is None:
        raise ValueError("this parameter is not trained by a zerodp.deepspeed engine; pass a parameter of "
                         "engine.module")
    return wrapper.engine


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """The parameter's whole fp32 (master) value, on CPU."""
    return whole_param_value(_engine_of(param), param, MASTER)


def safe_get_full_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The parameter's whole averaged gradient (loss scale divided out), between backward and step at an
    accumulation boundary; None for a frozen parameter."""
    return whole_param_value(_engine_of(param), param, GRAD)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    """The parameter's whole optimizer state tensor `optim_state_key` (e.g. 'exp_avg'); None before a step."""
    return whole_param_value(_engine_of(param), param, optim_state_key)
