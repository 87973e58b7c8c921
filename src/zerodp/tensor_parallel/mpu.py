"""The model-parallel unit (Megatron's "mpu"): which ranks hold tensor-parallel shards of one model copy,
and which ranks hold the copies that ZeRO shards over (data parallel).

A world of `tp * dp` ranks is a grid: rank r is tensor-parallel rank `r % tp` of data-parallel replica
`r // tp` (Megatron's order: a tensor-parallel group is `tp` consecutive ranks, so it stays inside one
node when tp divides the GPUs per node). The tensor-parallel group of r is {r - r % tp, ..., + tp - 1};
its data-parallel group is {r % tp, r % tp + tp, ...}.

`ModelParallelUnit` answers Megatron's questions by name (`get_model_parallel_rank/world_size/group`,
`get_data_parallel_rank/world_size/group`, and the `get_tensor_model_parallel_*` spellings), so it can be
passed as `mpu=` wherever Megatron's module is (`zerodp.initialize`, `zerodp.deepspeed.initialize`,
`deepspeed.checkpointing.configure`). It holds its groups; nothing here is a module-level global.
Depends on torch only (zerodp.tools.models imports it).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

REQUIRED_MPU_METHODS = ("get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
                        "get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size")


def new_group(ranks: list[int], backend: Optional[str]) -> dist.ProcessGroup:
    """torch's `new_group`, returned once every member has connected to it where the backend connects at creation
    (gloo): zerodp/comm/communicator.py's [Note: a communicator is made when every member has connected], written
    here again because this package imports no other zerodp package (zerodp.tools.models imports it)."""
    group = dist.new_group(ranks, backend=backend)
    if dist.get_rank() in ranks and len(ranks) > 1 and "gloo" in str(dist.get_backend(group)):
        dist.all_reduce(torch.zeros(1), group=group)  # a sync point by design, as there
    return group


def check_mpu(mpu: Any) -> None:
    """One clear error if `mpu` lacks a method ZeRO reads (Megatron's names; the `tensor_model_parallel`
    spellings are accepted for the model-parallel ones)."""
    missing = [m for m in REQUIRED_MPU_METHODS
               if not callable(getattr(mpu, m, None))
               and not callable(getattr(mpu, m.replace("_model_parallel", "_tensor_model_parallel"), None))]
    if missing:
        raise TypeError(f"mpu={type(mpu).__name__} lacks {', '.join(missing)}: pass Megatron's mpu module or "
                        f"zerodp.tensor_parallel.ModelParallelUnit, which have them")


def mpu_call(mpu: Any, name: str):
    """mpu.<name>(), or its `tensor_model_parallel` spelling (Megatron-LM's newer name)."""
    fn = getattr(mpu, name, None)
    if not callable(fn):
        fn = getattr(mpu, name.replace("_model_parallel", "_tensor_model_parallel"))
    return fn()


class ModelParallelUnit:
    """Tensor- and data-parallel process groups over the default group (see the module docstring)."""

    def __init__(self, tensor_parallel_size: int, *, backend: Optional[str] = None) -> None:
        """Build the groups; every rank of the default group must call this (torch's `new_group` is collective)."""
        if not dist.is_initialized():
            raise RuntimeError("ModelParallelUnit needs torch.distributed initialized first "
                               "(torch.distributed.init_process_group, or run under torchrun)")
        world, rank = dist.get_world_size(), dist.get_rank()
        if tensor_parallel_size < 1 or world % tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must be >= 1 and divide the world size "
                             f"{world}; pick a divisor of {world}")
        tp = tensor_parallel_size
        self._tp_size, self._dp_size = tp, world // tp
        self._tp_group = self._dp_group = None
        # note: new_group is collective over the whole world: every rank creates every group, in one order
        for first in range(0, world, tp):
            ranks = list(range(first, first + tp))
            group = new_group(ranks, backend)
            if rank in ranks:
                self._tp_group = group
        for tp_rank in range(tp):
            ranks = list(range(tp_rank, world, tp))
            group = new_group(ranks, backend)
            if rank in ranks:
                self._dp_group = group
        self._tp_rank, self._dp_rank = rank % tp, rank // tp

    # -- tensor (model) parallel ----------------------------------------------------------------

    def get_tensor_model_parallel_group(self):
        return self._tp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self._tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._tp_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        """The global rank of tensor-parallel rank 0 in this rank's group (Megatron's broadcast source)."""
        return dist.get_rank() - self._tp_rank

    # Megatron's older spellings; there is no pipeline parallelism here, so "model parallel" is tensor parallel
    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_src_rank = get_tensor_model_parallel_src_rank

    # -- data parallel --------------------------------------------------------------------------

    def get_data_parallel_group(self):
        return self._dp_group

    def get_data_parallel_rank(self) -> int:
        return self._dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self._dp_size

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1  # asked by DeepSpeed-style code; no pipeline stages here

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def destroy(self) -> None:
        """Destroy this rank's two groups (before the default group is destroyed; see comm's [Note: teardown])."""
        for group in (self._tp_group, self._dp_group):
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)
        self._tp_group = self._dp_group = None

    def __repr__(self) -> str:
        return (f"ModelParallelUnit(tp={self._tp_rank}/{self._tp_size}, dp={self._dp_rank}/{self._dp_size})")
