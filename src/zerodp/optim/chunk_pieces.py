"""Each unit's parameters cut at its optimizer chunks, computed once: `ChunkPieces`.

A piece is the part of one parameter that lies in one chunk ([Note: optimizer chunks] in optimizer.py):
(the parameter's index in its unit's layout, start, stop), in the chunk's own elements. A chunk's pieces
are in layout order, so adjacent pieces are adjacent in memory.

The step asks, chunk by chunk, which of its parameters got a gradient, missed one or are late (the untouched
parameters' snapshot in optimizer.py, the sliced and late steps of step_counts.py). The layout and the chunks are
fixed when the optimizer is built, so the pieces are too: the step walks these lists instead of re-deriving
every unit's segments and searching the chunk offsets for each of them (a 64-expert MoE has ~135 parameters
per block; the step used to pay ~0.5 ms a step for that alone, bench/results/moe_optimizer_step.md).
Whole-tensor units (flat/whole_tensor_layout.py: one chunk per parameter, skipped by torch when it has no
gradient) have none.
"""

from __future__ import annotations

import bisect
import itertools
from typing import NamedTuple

import torch


class Piece(NamedTuple):
    """One parameter's elements [start, stop) of one chunk; `param`: its index in the unit's layout."""

    param: int
    start: int
    stop: int


class ChunkPieces:
    """Per unit, per chunk: (chunk, its pieces); see the module docstring."""

    def __init__(self, units: list, chunks: list[list[torch.Tensor]], whole: list[bool]) -> None:
        self.of_unit: list[list[tuple[torch.Tensor, tuple[Piece, ...]]]] = [
            [] if is_whole else _cut(unit.layout.segments(unit.shard_index), unit_chunks)
            for unit, unit_chunks, is_whole in zip(units, chunks, whole)]


def _cut(segments, chunks: list[torch.Tensor]) -> list[tuple[torch.Tensor, tuple[Piece, ...]]]:
    """The segments (shard offsets, layout order) cut at the chunk boundaries."""
    starts = list(itertools.accumulate((c.numel() for c in chunks), initial=0))
    pieces: list[list[Piece]] = [[] for _ in chunks]
    for seg in segments:
        lo, hi = seg.shard_start, seg.shard_start + seg.numel
        k = bisect.bisect_right(starts, lo) - 1
        while k < len(chunks) and starts[k] < hi:
            a, b = max(lo, starts[k]), min(hi, starts[k + 1])
            if a < b:
                pieces[k].append(Piece(seg.param_index, a - starts[k], b - starts[k]))
            k += 1
    return [(chunk, tuple(p)) for chunk, p in zip(chunks, pieces)]
