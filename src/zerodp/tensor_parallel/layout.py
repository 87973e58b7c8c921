"""Where a tensor-parallel parameter's shards sit in the whole parameter: `ShardSpec`, and the slicing and
merging it implies.

A parameter sharded over `tp` ranks is cut along `dim`. With `stride` s > 1 the whole parameter is s
blocks along `dim` (a fused q|k|v weight: s = 3) and each block is cut in `tp` parts, rank t holding part
t of every block, concatenated (Megatron's `partition_stride`). So
    shard(t) = cat_b chunk(block_b, tp)[t]        whole = cat_b cat_t chunk(shard(t), s)[b]

Which parameters are sharded is read from the model, not stuck on the parameters by zerodp:
`tensor_parallel_specs(model)` asks every module that has `tensor_parallel_specs()` (zerodp's parallel
layers) for its own parameters' specs, and also honours Megatron's attributes on a parameter
(`tensor_model_parallel=True`, `partition_dim`, `partition_stride`), which real Megatron models carry.
Depends on torch only.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import torch
from torch import nn


class ShardSpec(NamedTuple):
    """A tensor-parallel parameter: cut along `dim`, in `stride` interleaved blocks (see the module docstring)."""

    dim: int = 0
    stride: int = 1


def shard_tensor(whole: torch.Tensor, spec: ShardSpec, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s shard of `whole` (a copy)."""
    blocks = whole.chunk(spec.stride, dim=spec.dim)
    if any(b.size(spec.dim) % world for b in blocks) or whole.size(spec.dim) % spec.stride:
        raise ValueError(f"dimension {spec.dim} of shape {tuple(whole.shape)} does not split into {spec.stride} "
                         f"block(s) of {world} equal parts; pick sizes divisible by stride x tensor-parallel size")
    return torch.cat([b.chunk(world, dim=spec.dim)[rank] for b in blocks], dim=spec.dim).clone()


def merge_shards(shards: Sequence[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The whole tensor from every rank's shard, in rank order (inverse of `shard_tensor`)."""
    per_rank = [s.chunk(spec.stride, dim=spec.dim) for s in shards]
    return torch.cat([per_rank[t][b] for b in range(spec.stride) for t in range(len(shards))], dim=spec.dim)


def tensor_parallel_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """{parameter name: ShardSpec} of every tensor-parallel parameter of `model` (module docstring)."""
    specs: dict[str, ShardSpec] = {}
    for prefix, module in model.named_modules():
        declare = getattr(module, "tensor_parallel_specs", None)
        if callable(declare) and module is not model:
            for local, spec in declare().items():
                specs[f"{prefix}.{local}" if prefix else local] = spec
    for name, param in model.named_parameters():
        if getattr(param, "tensor_model_parallel", False) and name not in specs:
            specs[name] = ShardSpec(int(getattr(param, "partition_dim", 0)), int(getattr(param, "partition_stride", 1)))
    return specs


def sharded_parameter_ids(model: nn.Module) -> set[int]:
    """ids of the tensor-parallel parameters of `model` (a tied one once, under any of its names)."""
    specs = tensor_parallel_specs(model)
    return {id(p) for name, p in model.named_parameters(remove_duplicate=False) if name in specs}


def merge_state_dicts(per_rank: Sequence[Mapping[str, torch.Tensor]],
                      specs: Mapping[str, ShardSpec]) -> dict[str, torch.Tensor]:
    """The unsharded state dict from each tensor-parallel rank's state dict (rank order): sharded entries
    merged by their spec, replicated ones taken from rank 0 (they are equal on every rank)."""
    names = list(per_rank[0])
    for rank, sd in enumerate(per_rank[1:], start=1):
        if list(sd) != names:
            raise ValueError(f"tensor-parallel rank {rank}'s state dict has other keys than rank 0's; "
                             f"merge state dicts of one model saved at one step")
    return {name: merge_shards([sd[name] for sd in per_rank], specs[name]) if name in specs else per_rank[0][name]
            for name in names}
