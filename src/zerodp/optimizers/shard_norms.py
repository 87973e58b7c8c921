"""Per-parameter norms of tensors that may be flat shards of several parameters.

LARC and LAMB scale each parameter's update by a ratio of whole-parameter norms. Under ZeRO the
optimizer sees flat shards: one tensor holds pieces of several parameters, and one parameter may be
split across ranks. `ShardNorms` knows, for each tensor it was bound to, which parameter each
element range belongs to; it sums squares per parameter locally, all-reduces one small vector across
the shard group, and expands the norms back to one value per element. Unbound tensors are whole
parameters, so the same optimizers run unchanged in plain single-process PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .. import comm


@dataclass(frozen=True)
class TensorSegments:
    """Element ranges of one flat tensor: `lengths[i]` elements belong to parameter slot `slots[i]`."""

    slots: torch.Tensor     # int64 [num_segments]
    lengths: torch.Tensor   # int64 [num_segments]; their sum may be less than numel (trailing padding)


class ShardNorms:
    """Computes whole-parameter norms for tensors bound to parameter slots (see module docstring)."""

    def __init__(self) -> None:
        self._segments: dict[int, TensorSegments] = {}
        self._num_slots = 0
        self._group: comm.ProcessGroup = None
        self._sharded = False

    def bind(self, segments: dict[torch.Tensor, TensorSegments], num_slots: int,
             process_group: comm.ProcessGroup, sharded: bool) -> None:
        """Declare the flat layout of the optimizer's tensors (called by zerodp's sharded optimizer)."""
        self._segments = {id(t): s for t, s in segments.items()}
        self._num_slots = num_slots
        self._group = process_group
        self._sharded = sharded

    def norms(self, tensors: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """For each tensor (a parameter or a tensor shaped like it: its gradient, its update), a
        same-shaped tensor holding, per element, the whole-parameter norm of that tensor."""
        if not self._segments:
            return [torch.linalg.vector_norm(t).expand_as(t) for t in tensors]
        squares = torch.zeros(self._num_slots, dtype=torch.float32, device=tensors[0].device)
        plans = []
        for t, p in zip(tensors, params):
            seg = self._segments[id(p)]
            used = int(seg.lengths.sum())
            if used == 0:  # a chunk of padding only
                plans.append((seg, 0, t))
                continue
            flat = t.reshape(-1).float()
            partial = torch.segment_reduce(flat[:used] * flat[:used], "sum", lengths=seg.lengths)
            squares.index_add_(0, seg.slots, partial)
            plans.append((seg, used, t))
        if self._sharded:
            comm.all_reduce(squares, self._group, tag="norm")
        norms = squares.sqrt()
        out = []
        for seg, used, t in plans:
            per_elem = torch.zeros(t.numel(), dtype=t.dtype, device=t.device)
            if used:
                per_elem[:used] = norms[seg.slots].repeat_interleave(seg.lengths).to(t.dtype)
            out.append(per_elem.view_as(t))
        return out


def segments_from_layout(slot_of_param: Sequence[int], segments) -> TensorSegments:
    """Build `TensorSegments` from `partition.Segment`s (contiguous, in shard order, padding last)."""
    slots = torch.tensor([slot_of_param[s.param_index] for s in segments], dtype=torch.long)
    lengths = torch.tensor([s.numel for s in segments], dtype=torch.long)
    return TensorSegments(slots, lengths)


def split_segments(segments: TensorSegments, lengths: list[int]) -> list[TensorSegments]:
    """Cut a tensor's segments at the boundaries of consecutive pieces of the given lengths."""
    out, pieces = [], list(zip(segments.slots.tolist(), segments.lengths.tolist()))
    k, left = 0, pieces[0][1] if pieces else 0
    for length in lengths:
        slots, lens, need = [], [], length
        while need and k < len(pieces):
            take = min(need, left)
            slots.append(pieces[k][0])
            lens.append(take)
            need, left = need - take, left - take
            if left == 0:
                k += 1
                left = pieces[k][1] if k < len(pieces) else 0
        out.append(TensorSegments(torch.tensor(slots, dtype=torch.long), torch.tensor(lens, dtype=torch.long)))
    return out


def maybe_bind(optimizer, segments: dict, num_slots: int, group: comm.ProcessGroup, sharded: bool) -> bool:
    """Bind shard layout to an optimizer that computes per-parameter norms; False if it needs none."""
    norms: Optional[ShardNorms] = getattr(optimizer, "shard_norms", None)
    if norms is None:
        return False
    norms.bind(segments, num_slots, group, sharded)
    return True
