"""The four communication operators of Megatron's tensor parallelism, as autograd functions.

In Megatron-LM's paper (Shoeybi et al. 2019, section 3) an MLP block is `Y = GeLU(X A)`, `Z = Y B` with A
split by columns and B by rows; two conjugate operators make it exact:
    f: identity forward, all-reduce backward   (`copy_to_tensor_parallel`, before a column-parallel layer:
       every rank's partial input gradient is one part of the whole)
    g: all-reduce forward, identity backward   (`reduce_from_tensor_parallel`, after a row-parallel layer:
       every rank's partial output is one part of the sum)
Two more move a split dimension: `gather_from_tensor_parallel` (all-gather the last dimension forward,
keep this rank's slice backward) and `scatter_to_tensor_parallel` (its inverse). A group of one rank makes
each of them the identity. Depends on torch only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _world(group) == 1:
        return x
    x = x.contiguous().clone()  # the input may be saved for backward elsewhere: reduce a copy
    dist.all_reduce(x, group=group)
    return x


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    if x.size(-1) % world:
        raise ValueError(f"last dimension {x.size(-1)} does not divide over {world} tensor-parallel ranks")
    return x.chunk(world, dim=-1)[dist.get_rank(group)].contiguous()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


def copy_to_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient over `group` backward."""
    return _CopyToGroup.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """g: all-reduce over `group` forward, identity backward."""
    return _ReduceFromGroup.apply(x, group)


def gather_from_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather the last dimension over `group` forward; this rank's slice of the gradient backward."""
    return _GatherFromGroup.apply(x, group)


def scatter_to_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of the last dimension forward; all-gather of the gradient backward."""
    return _ScatterToGroup.apply(x, group)
