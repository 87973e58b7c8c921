"""One parameter's whole (unsharded) values from a live engine: its fp32 master, its averaged gradient and
its optimizer states, each gathered from every rank's shard (`whole_param_value`).

Collective: every rank of the engine's group must call it for the same parameter. The adapters' per-parameter
getters (zerodp.deepspeed.utils' safe_get_full_*) are built on it; like `full_state_dict`, it reads the
engine only through the seams a checkpoint reads (seams.CheckpointEngine).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..shard.seams import CheckpointEngine
from .consolidate import gather_flat
from .state import master_index, sharded_units

MASTER = "fp32"   # what: the fp32 master value
GRAD = "grad"     # what: the averaged gradient (loss scale divided out)


def whole_param_value(engine: CheckpointEngine, param: torch.nn.Parameter, what: str) -> Optional[torch.Tensor]:
    """`param`'s whole value, on CPU in fp32: `what` is MASTER, GRAD, or an optimizer state key (e.g.
    'exp_avg'). None where there is none: the gradient or state of a frozen parameter, a state before the
    first step. The gradient is read between backward and step at an accumulation boundary."""
    unit, master, k = _locate(engine, param)
    if what == MASTER:
        with unit.resident():  # offload_param: the shard is in memory only while held
            return _whole(engine, unit, master if master is not None else unit.param_shard, k)
    if master is None:
        return None
    if what == GRAD:
        with unit.grad_resident():  # fp32 offload_param nvme: gradient shards are held like parameters
            return _whole(engine, unit, unit.grad_shard.float() / engine.scaler.scale, k)
    state = engine.optimizer.state_of(master_index(engine, master))
    if what not in state:
        return None
    value = state[what]
    if not torch.is_tensor(value) or value.shape != master.shape:
        raise ValueError(f"optimizer state '{what}' is a scalar, not per element; read "
                         f"engine.optimizer.state_of(...) instead")
    return _whole(engine, unit, value, k)


def _locate(engine: CheckpointEngine, param: torch.nn.Parameter):
    for unit, master in sharded_units(engine):
        for k, p in enumerate(unit.params):
            if p is param:
                return unit, master, k
    raise ValueError("this parameter is not sharded by the engine (is it frozen?)")


def _whole(engine: CheckpointEngine, unit, flat_shard: torch.Tensor, k: int) -> torch.Tensor:
    chunk = engine.config.zero_optimization.allgather_bucket_size
    flat = gather_flat(unit.layout, flat_shard, engine.sharding.state_group, chunk, keep=True)
    offset, numel, shape = unit.layout.offsets[k], unit.layout.numels[k], unit.layout.shapes[k]
    return flat[offset:offset + numel].view(shape).clone()
