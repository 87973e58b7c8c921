"""ZeRO beside tensor parallelism: the gradient norm and the overflow flag over the whole 2-D world.

ZeRO shards over the data-parallel group; each tensor-parallel rank runs its own ZeRO over its own
parameters. Two decisions must still be the same everywhere, or the tensor-parallel copies drift apart:

  norm      the unsharded model's gradient norm. A tensor-parallel parameter's shards are disjoint parts of
            the whole, so their squares are summed over the tensor-parallel group; a replicated parameter
            (a LayerNorm, a row-parallel bias, the position embedding) has the same gradient on every
            tensor-parallel rank, so it is counted once, on tensor-parallel rank 0 (Megatron's and DeepSpeed's
            rule). Then ||g||^2 = sum_dp [ sum_tp sharded^2 + replicated^2 on tp rank 0 ].
  overflow  fp16: an inf/nan on any rank of either group skips the step on all of them, so the loss scale
            moves alike everywhere.

Which parameters are tensor-parallel is read from the model (tensor_parallel.layout.sharded_parameter_ids:
zerodp's parallel layers, or Megatron's `tensor_model_parallel` attribute).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable

import torch

from .. import comm
from ..shard.grads.grad_shard import square_norm
from ..shard.seams import ShardedUnit
from ..tensor_parallel.mpu import check_mpu, mpu_call

log = logging.getLogger("zerodp")

class ModelParallelNorm:
    """The norm and overflow rules of the module docstring, for one tensor-parallel rank."""

    def __init__(self, group: comm.ProcessGroup, rank: int, world_size: int, sharded_ids: Iterable[int]) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.sharded_ids = frozenset(sharded_ids)

    @classmethod
    def from_mpu(cls, mpu: Any, sharded_ids: Iterable[int]) -> "ModelParallelNorm":
        return cls(mpu_call(mpu, "get_model_parallel_group"), mpu_call(mpu, "get_model_parallel_rank"),
                   mpu_call(mpu, "get_model_parallel_world_size"), sharded_ids)

    def square_norms(self, units: list[ShardedUnit], grads: list[torch.Tensor]) -> torch.Tensor:
        """float64 [sharded, replicated] squares of this rank's gradient shards."""
        sq = torch.zeros(2, dtype=torch.float64, device=grads[0].device if grads else None)
        for unit, g in zip(units, grads):
            flags = [id(p) in self.sharded_ids for p in unit.params]
            if all(flags) or not any(flags):
                own = unit.grad_square_norm() if g is unit.grad_shard else square_norm(g)
                sq[0 if flags and flags[0] else 1] += own
                continue
            with unit.grad_resident() if g is unit.grad_shard else contextlib.nullcontext():
                for seg in unit.layout.segments(unit.shard_index):
                    part = g[seg.shard_start:seg.shard_start + seg.numel]
                    sq[0 if flags[seg.param_index] else 1] += square_norm(part)
        return sq

    def global_norm_squared(self, sq: torch.Tensor, data_parallel: comm.ProcessGroup, sharded: bool) -> float:
        """||g||^2 of the unsharded model from this rank's [sharded, replicated] squares (collectives)."""
        if sharded:
            comm.all_reduce(sq, data_parallel, tag="norm")
        if self.rank != 0:
            sq[1] = 0.0  # a replicated parameter counts once: tensor-parallel rank 0 holds the count
        comm.all_reduce(sq, self.group, tag="norm")  # note: a sync point across the tensor-parallel group
        return float(sq.sum())

    def any_overflow(self, overflow: bool) -> bool:
        """True on every tensor-parallel rank if any saw an overflow (after the data-parallel vote)."""
        return comm.all_reduce_max_flag(overflow, self.group, tag="control")


def data_parallel_group(mpu: Any, process_group: comm.ProcessGroup) -> comm.ProcessGroup:
    """The group ZeRO shards over: `process_group`, or the mpu's data-parallel group (not both, unless the same)."""
    if mpu is None:
        return process_group
    check_mpu(mpu)
    group = mpu_call(mpu, "get_data_parallel_group")
    if process_group is not None and process_group is not group:
        raise ValueError("pass either process_group= or mpu= (ZeRO then shards over mpu.get_data_parallel_group()), "
                         "not both")
    return group


def model_parallel_norm(mpu: Any, model) -> "ModelParallelNorm | None":
    """The norm rule for `model` under `mpu` (None without one)."""
    if mpu is None:
        return None
    from ..tensor_parallel.layout import sharded_parameter_ids

    sharded = sharded_parameter_ids(model)
    if not sharded and mpu_call(mpu, "get_model_parallel_world_size") > 1:
        log.warning("zerodp: mpu has %d tensor-parallel ranks but the model marks no parameter as tensor-parallel "
                    "(zerodp.tensor_parallel layers, or Megatron's tensor_model_parallel attribute); every "
                    "parameter is counted once in the gradient norm", mpu_call(mpu, "get_model_parallel_world_size"))
    return ModelParallelNorm.from_mpu(mpu, sharded)
