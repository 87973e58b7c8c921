"""The all-to-all of expert parallelism, differentiable: `all_to_all`.

Dispatch sends the r-th of ep_size equal slices of a [E, C, M] buffer (the tokens for rank r's experts) to
rank r and receives, in slice s, rank s's tokens for this rank's experts; combine sends them back the same
way. The transpose of an all-to-all is an all-to-all, so backward sends the gradient back by the same call.
On gloo this is torch's `all_to_all_single` (gloo implements it: tests/dist/test_moe_ep.py runs it on 4 ranks).
"""

from __future__ import annotations

import torch

from .. import comm


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: comm.ProcessGroup, tag: str) -> torch.Tensor:
        ctx.group, ctx.tag = group, tag
        return _exchange(tensor, group, tag)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group, ctx.tag), None, None


def all_to_all(tensor: torch.Tensor, group: comm.ProcessGroup, tag: str = "moe") -> torch.Tensor:
    """Exchange equal slices of `tensor`'s first dimension across `group` (module docstring); autograd-aware."""
    if group is None or comm.get_world_size(group) == 1:
        return tensor
    if tensor.requires_grad:
        return _AllToAll.apply(tensor, group, tag)
    return _exchange(tensor, group, tag)


def _exchange(tensor: torch.Tensor, group: comm.ProcessGroup, tag: str) -> torch.Tensor:
    # contiguous first: empty_like keeps a permuted tensor's strides (a gradient from einsum's backward is one),
    # while all_to_all_single reads and writes memory in row-major order; a permuted `out` would scramble the
    # slots (seen as wrong expert gradients whenever the capacity was 2 or more)
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    comm.all_to_all(out, tensor, group, tag=tag)
    return out
