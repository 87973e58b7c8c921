"""Pa: a checkpointed input split across the model-parallel group, one 1/TP piece per rank.

In a tensor-parallel model the input of every transformer block (the residual stream) is replicated
on the TP ranks, so keeping it whole on each is TP-fold redundant. The ZeRO paper's Pa keeps
ceil(numel / TP) elements per rank and all-gathers the whole input just before the recomputation:
kept bytes per rank fall from B*T*C*d to B*T*C*d/TP per checkpoint, for one all-gather per
checkpoint in backward.

DeepSpeed asserts that numel is a multiple of TP; here the last piece is zero-padded instead (at
most TP-1 elements), so any shape partitions.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import comm
from .model_parallel import ModelParallelGroup


def piece_numel(numel: int, world_size: int) -> int:
    """Elements each rank keeps of a `numel`-element input: ceil(numel / world_size)."""
    return -(-numel // world_size)


def keep_piece(tensor: torch.Tensor, group: ModelParallelGroup, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's piece of `tensor` (flattened), copied into `out` or a new tensor (never a view: the whole
    input's storage must be free to go once the region's forward is done)."""
    flat = tensor.detach().reshape(-1)
    per_rank = piece_numel(flat.numel(), group.world_size)
    start = min(group.rank * per_rank, flat.numel())
    stop = min(start + per_rank, flat.numel())
    if out is None:
        out = torch.empty(per_rank, dtype=tensor.dtype, device=tensor.device)
    out[: stop - start].copy_(flat[start:stop])
    if stop - start < per_rank:
        out[stop - start:].zero_()  # the padding of the last piece: its value is never read back
    return out


def gather_whole(piece: torch.Tensor, shape: torch.Size, group: ModelParallelGroup,
                 device: torch.device) -> torch.Tensor:
    """The whole input from every rank's piece, on `device`. A collective: every rank of the group calls it,
    in the same order (each rank recomputes the same regions in the same order)."""
    numel = shape.numel()
    per_rank = piece.numel()
    whole = torch.empty(per_rank * group.world_size, dtype=piece.dtype, device=device)
    mine = whole.narrow(0, group.rank * per_rank, per_rank)
    mine.copy_(piece, non_blocking=piece.device != device)
    if group.world_size > 1:
        comm.all_gather(whole, mine, group.group, tag="activation_checkpoint", what="partitioned activation")
    return whole[:numel].view(shape)
