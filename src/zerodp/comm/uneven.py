"""Collectives over shards of unequal sizes: `all_gather_uneven`, `reduce_scatter_uneven`.

Stage 3's whole-tensor units (flat/whole_tensor_layout.py's UnpaddedWholeTensorLayout) give each
rank exactly the tensors it owns, so shard r is the range `ranges[r]` of the flat buffer and the
ranges differ in length. gloo refuses uneven all-gathers and torch's tensor-form collectives want
equal shards, so:

    all_gather_uneven      one broadcast per rank that owns anything, from that rank, of its range;
                           on gloo the pairwise exchange of comm/pairwise.py, as all_gather
    reduce_scatter_uneven  one reduce per owning rank, to that rank, of its range (NCCL); on gloo the
                           pairwise exchange, as reduce_scatter; with use_all_reduce one all-reduce

Each element crosses the wire as often as in an all-gather / reduce-scatter of the unpadded buffer
(a broadcast or reduce of n elements moves what 1/N of an all-gather or reduce-scatter of N x n
moves), so the traffic is the unit's real size; the cost is one collective per owning rank instead of
one per unit. Every rank knows `ranges` (they come from the layout), so every rank skips the same
empty shards and issues the same sequence. Logged as one all_gather / reduce_scatter of the buffer.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
import torch.distributed as dist

from .collectives import Handle, ProcessGroup, _finish, _log, backend_name, get_rank, issues_no_collectives
from .pairwise import Works, exchange_all_gather, exchange_reduce_scatter


def _check(buffer: torch.Tensor, ranges: Sequence[tuple[int, int]], what: str) -> None:
    if ranges[-1][1] != buffer.numel() or any(a[1] != b[0] for a, b in itertools.pairwise(ranges)):
        raise ValueError(f"{what}: shard ranges {list(ranges)} do not tile a buffer of {buffer.numel()} elements")


def _global(group: ProcessGroup, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def all_gather_uneven(output: torch.Tensor, input: torch.Tensor, ranges: Sequence[tuple[int, int]],
                      group: ProcessGroup = None, *, async_op: bool = False, tag: str = "",
                      what: str = "") -> Handle:
    """Fill `output` with every rank's `input`, rank r's landing in `output[ranges[r]]`."""
    _check(output, ranges, "all_gather_uneven")
    lo, hi = ranges[get_rank(group)]
    if input.numel() != hi - lo:
        raise ValueError(f"all_gather_uneven: this rank's input has {input.numel()} elements, its range {hi - lo}")
    mine = output[lo:hi]
    if input.data_ptr() != mine.data_ptr() or input.numel() == 0:
        mine.copy_(input)
    if issues_no_collectives(group):
        _log("all_gather", "none", output, tag, group, what)
        return Handle()
    world = len(ranges)
    if backend_name(group) == "gloo" and world > 1:  # one gloo rank: the real broadcast (tests/gpu's path)
        entry = _log("all_gather", "pairwise", output, tag, group, what)
        work = exchange_all_gather(output, mine, group, get_rank(group), world, ranges)
        return _finish(work, None, async_op, entry, group)
    entry = _log("all_gather", "broadcast", output, tag, group, what)
    works = [dist.broadcast(output[a:b], src=_global(group, r), group=group, async_op=True)
             for r, (a, b) in enumerate(ranges) if b > a]
    return _finish(Works(works), None, async_op, entry, group)


def reduce_scatter_uneven(output: torch.Tensor, input: torch.Tensor, ranges: Sequence[tuple[int, int]],
                          group: ProcessGroup = None, *, async_op: bool = False, use_all_reduce: bool = False,
                          tag: str = "", what: str = "") -> Handle:
    """Sum `input` across the group and leave `input[ranges[rank]]`'s sum in `output`.

    `input`'s contents are undefined afterwards (parts of it hold sums)."""
    _check(input, ranges, "reduce_scatter_uneven")
    lo, hi = ranges[get_rank(group)]
    if output.numel() != hi - lo:
        raise ValueError(f"reduce_scatter_uneven: output has {output.numel()} elements, this rank's range {hi - lo}")
    mine = input[lo:hi]

    def keep_slice() -> None:
        if output.numel() and output.data_ptr() != mine.data_ptr():
            output.copy_(mine)

    if issues_no_collectives(group):
        _log("reduce_scatter", "none", input, tag, group, what)
        keep_slice()
        return Handle()
    gloo = backend_name(group) == "gloo"
    if gloo and not use_all_reduce and len(ranges) > 1:  # see comm/collectives.py's module note
        entry = _log("reduce_scatter", "pairwise", input, tag, group, what)
        work, finish = exchange_reduce_scatter(output, input, group, get_rank(group), len(ranges), ranges)
        return _finish(work, finish, async_op, entry, group)
    if use_all_reduce or gloo:  # one gloo rank: a real call (tests/gpu's path)
        entry = _log("reduce_scatter", "all_reduce", input, tag, group, what)
        return _finish(dist.all_reduce(input, group=group, async_op=True), keep_slice, async_op, entry, group)
    entry = _log("reduce_scatter", "reduce", input, tag, group, what)
    works = [dist.reduce(input[a:b], dst=_global(group, r), group=group, async_op=True)
             for r, (a, b) in enumerate(ranges) if b > a]
    return _finish(Works(works), keep_slice, async_op, entry, group)
