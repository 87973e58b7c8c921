"""Megatron's tensor-parallel layers: column- and row-parallel linears and a vocab-parallel embedding.

    ColumnParallelLinear   Y_t = X A_t (+ b_t): A cut by output features; input passes f (all-reduce of its
                           gradient), output stays split (or is all-gathered with gather_output=True)
    RowParallelLinear      Y = sum_t X_t A_t (+ b): A cut by input features; g all-reduces the partial outputs,
                           then the bias (replicated) is added once
    VocabParallelEmbedding rows [t V/tp, (t+1) V/tp) of the table on rank t; other ids look up zeros and g sums

Each layer holds only its shard and says which of its parameters are sharded, and how, through
`tensor_parallel_specs()` (read by `layout.tensor_parallel_specs`); `load_whole(name, tensor)` copies this
rank's part of a whole parameter in. Weights are stored as torch's Linear stores them ([out, in]).
Depends on torch only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .layout import ShardSpec, shard_tensor
from .mappings import (copy_to_tensor_parallel, gather_from_tensor_parallel, reduce_from_tensor_parallel,
                       scatter_to_tensor_parallel)


def group_rank_and_size(group) -> tuple[int, int]:
    """(rank, size) in `group`; (0, 1) for None (no tensor parallelism)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _divide(whole: int, parts: int, what: str) -> int:
    if whole % parts:
        raise ValueError(f"{what}={whole} is not divisible by the tensor-parallel size {parts}; "
                         f"pick a tensor-parallel size that divides it")
    return whole // parts


class _ShardedLayer(nn.Module):
    """What the parallel layers share: their group, their specs, and loading a whole parameter."""

    _specs: dict[str, ShardSpec] = {}

    def tensor_parallel_specs(self) -> dict[str, ShardSpec]:
        return {name: spec for name, spec in self._specs.items() if getattr(self, name, None) is not None}

    @torch.no_grad()
    def load_whole(self, name: str, whole: torch.Tensor) -> None:
        """Set parameter `name` from the whole (unsharded) tensor: this rank keeps its part."""
        param = getattr(self, name)
        spec = self.tensor_parallel_specs().get(name)
        param.copy_(whole if spec is None else shard_tensor(whole, spec, self.tp_rank, self.tp_size))


class ColumnParallelLinear(_ShardedLayer):
    """`Y = X A^T + b` with A's output features (and b) split over the group; `stride`: see layout.ShardSpec."""

    def __init__(self, in_features: int, out_features: int, group=None, *, bias: bool = True, stride: int = 1,
                 gather_output: bool = False) -> None:
        super().__init__()
        self.group, self.gather_output = group, gather_output
        self.tp_rank, self.tp_size = group_rank_and_size(group)
        local = _divide(out_features, self.tp_size * stride, "out_features / stride") * stride
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.zeros(local)) if bias else None
        self._specs = {"weight": ShardSpec(0, stride), "bias": ShardSpec(0, stride)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tensor_parallel(x, self.group), self.weight, self.bias)
        return gather_from_tensor_parallel(y, self.group) if self.gather_output else y


class RowParallelLinear(_ShardedLayer):
    """`Y = X A^T + b` with A's input features split over the group; b is replicated and added after the sum."""

    def __init__(self, in_features: int, out_features: int, group=None, *, bias: bool = True,
                 input_is_parallel: bool = True) -> None:
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.tp_rank, self.tp_size = group_rank_and_size(group)
        self.weight = nn.Parameter(torch.empty(out_features, _divide(in_features, self.tp_size, "in_features")))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None  # replicated: added once, after g
        self._specs = {"weight": ShardSpec(1, 1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.group)
        y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(_ShardedLayer):
    """An embedding table cut by rows (token ids) over the group; its weight doubles as a tied output head
    (`parallel_logits`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None) -> None:
        super().__init__()
        self.group = group
        self.tp_rank, self.tp_size = group_rank_and_size(group)
        per_rank = _divide(num_embeddings, self.tp_size, "num_embeddings (vocab size)")
        self.vocab_start, self.vocab_end = self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim))
        self._specs = {"weight": ShardSpec(0, 1)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel(rows, self.group)  # each id's row lives on one rank: the sum is it

    def parallel_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's vocabulary slice: `f(hidden) @ weight^T` ([..., V / tp])."""
        return F.linear(copy_to_tensor_parallel(hidden, self.group), self.weight)
