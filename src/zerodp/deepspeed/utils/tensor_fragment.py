"""`deepspeed.utils`' safe getters of whole (unsharded) values for one parameter. Collective: every
rank must call them for the same parameter (they gather the shards)."""

from __future__ import annotations

from typing import Optional

import torch

from ...checkpoint.state import master_index, sharded_units
from ...checkpoint.consolidate import gather_flat


def _locate(param: torch.nn.Parameter):
    from ..engine import ENGINE_OF_PARAM

    wrapper = ENGINE_OF_PARAM.get(id(param))
    if wrapper is None:
        raise ValueError("this parameter is not trained by a zerodp.deepspeed engine; pass a parameter of "
                         "engine.module")
    engine = wrapper.engine
    for unit, master in sharded_units(engine):
        for k, p in enumerate(unit.params):
            if p is param:
                return engine, unit, master, k
    raise ValueError("this parameter is not sharded by the engine (is it frozen?)")


def _whole(engine, unit, flat_shard: torch.Tensor, k: int) -> torch.Tensor:
    chunk = engine.config.zero_optimization.allgather_bucket_size
    flat = gather_flat(unit.layout, flat_shard, engine.sharding.state_group, chunk, keep=True,
                       device=engine.placement.compute.device)  # a host master (ZeRO-Offload) is sent from there
    offset, numel, shape = unit.layout.offsets[k], unit.layout.numels[k], unit.layout.shapes[k]
    return flat[offset:offset + numel].view(shape).clone()


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """The parameter's whole fp32 (master) value, on CPU."""
    engine, unit, master, k = _locate(param)
    with unit.resident():  # offload_param: the shard is in memory only while held
        return _whole(engine, unit, master if master is not None else unit.param_shard, k)


def safe_get_full_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The parameter's whole averaged gradient (loss scale divided out), between backward and step at an
    accumulation boundary; None for a frozen parameter."""
    engine, unit, master, k = _locate(param)
    if master is None:
        return None
    with unit.grad_resident():  # fp32 offload_param nvme: gradient shards are held like parameters
        return _whole(engine, unit, unit.grad_shard.float() / engine.loss_scale, k)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    """The parameter's whole optimizer state tensor `optim_state_key` (e.g. 'exp_avg'); None before a step."""
    engine, unit, master, k = _locate(param)
    if master is None:
        return None
    state = engine.optimizer.state_of(master_index(engine, master))
    if optim_state_key not in state:
        return None
    value = state[optim_state_key]
    if not torch.is_tensor(value) or value.shape != master.shape:
        raise ValueError(f"optimizer state '{optim_state_key}' is a scalar, not per element; read "
                         f"engine.optimizer.state_of(...) instead")
    return _whole(engine, unit, value, k)
