"""The model-parallel (tensor-parallel) group that partitioned checkpoints are split across, read
from a Megatron-style `mpu` object.

An mpu answers `get_tensor_model_parallel_{group,rank,world_size}()` (Megatron-LM's newer names,
preferred as DeepSpeed prefers them) or `get_model_parallel_{group,rank,world_size}()`. Any torch
process group works as the group. `ModelParallelGroup.single()` is the no-model-parallelism case
(one rank, no collectives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..comm import ProcessGroup

_SPELLINGS = (("get_tensor_model_parallel_group", "get_tensor_model_parallel_rank",
               "get_tensor_model_parallel_world_size"),
              ("get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size"))


@dataclass(frozen=True)
class ModelParallelGroup:
    """This rank's place in its model-parallel group."""

    group: ProcessGroup
    rank: int
    world_size: int

    @classmethod
    def single(cls) -> "ModelParallelGroup":
        return cls(None, 0, 1)

    @classmethod
    def from_mpu(cls, mpu: Optional[Any]) -> Optional["ModelParallelGroup"]:
        """The group an mpu describes (None for no mpu); an object that is not an mpu is one clear error."""
        if mpu is None:
            return None
        for group_fn, rank_fn, size_fn in _SPELLINGS:
            if all(callable(getattr(mpu, name, None)) for name in (group_fn, rank_fn, size_fn)):
                group = cls(getattr(mpu, group_fn)(), int(getattr(mpu, rank_fn)()), int(getattr(mpu, size_fn)()))
                if group.world_size < 1 or not 0 <= group.rank < group.world_size:
                    raise ValueError(f"mpu reports model-parallel rank {group.rank} of {group.world_size}; "
                                     f"expected 0 <= rank < world_size")
                return group
        raise TypeError(f"mpu {type(mpu).__name__} is not a model-parallel unit: it needs "
                        f"get_tensor_model_parallel_group/_rank/_world_size() or get_model_parallel_group/_rank/"
                        f"_world_size() (Megatron's mpu); pass None for no model parallelism")
