"""Reduce-scatter and all-gather as direct pairwise exchanges, for gloo: `exchange_reduce_scatter`,
`exchange_all_gather`.

gloo has no fast reduce-scatter. Its own is a composite (2 ranks, 12.6 MB: 54-60 ms, blocking),
and an all-reduce of the full buffer (what zerodp used before) sends every byte twice (a ring's
reduce-scatter, then its all-gather: 21-50 ms). Here every rank sends each other rank the slice that
rank keeps, receives their contributions to its own slice ((N-1)/N of the buffer each way, the
bandwidth optimum of a reduce-scatter) and sums locally: 13-15 ms for the same buffer. (Measured on
the 2-core machine under load, torch 2.13 gloo, one thread per rank.)

The all-gather is the same exchange without the sum: every rank sends its shard to each peer and
receives theirs straight into their rows of the output (gloo's all_gather copies the input into a
staging buffer and the result out of one; nor is an input that aliases its row cloned). 2 ranks,
12/16/24 MiB outputs, near idle: gloo all_gather 10-15/11-13/22-24 ms, pairwise 6-7/8/11-14 ms; at
stage 3 on the benchmark GPT it removes about 0.1 s of CPU per step and rank (perf, all threads).

The pairwise all-gather takes any size as one asynchronous exchange: 2 ranks, one thread each, it
moved 4-6 GB/s of output from 8 MiB to 640 MiB, where gloo's own all-gather, sent as 24 MiB messages
through a staging buffer (it slows down above that size), moved 0.9-2.4 GB/s and blocked. A 3e9
GPT's 316 MB units spent 3.9 s of a 500m-proxy step's 16.7 s forward and backward in that path,
unable to prefetch (bench/results/big_offload_step.md).

Sum order: this rank's own slice first, then the others' in rank order. With two ranks this is
bitwise the `a + b` of an all-reduce (floating-point addition commutes); with more ranks the
result may differ from a ring all-reduce in the last bits (a different association).

[Note: pairwise order] Every exchange uses one tag. gloo queues sends and receives per peer and
tag in issue order and matches them first-in first-out, and every rank issues its reductions in
one order ([Note: collective order] in grads/reduce_queue.py), so several exchanges in flight
cannot mix their slices (tests/dist/test_pairwise_exchange.py checks it with several in flight).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..host_memory import advise_huge_pages

_TAG = 0x5A  # see [Note: pairwise order]
_GATHER_TAG = 0x5B


class Works:
    """Several asynchronous operations waited on as one (a `dist.Work` stand-in): the sends and
    receives of one exchange here, the per-owner collectives of comm/uneven.py."""

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []


def _even(numel: int, world: int) -> list[tuple[int, int]]:
    return [(r * numel, (r + 1) * numel) for r in range(world)]


def exchange_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, rank: int, world: int,
                            ranges: Optional[Sequence[tuple[int, int]]] = None):
    """Start the exchange; returns (work, finish): after `work.wait()`, `finish()` sums into `output`.

    Rank r keeps the sum of `input[ranges[r]]` (default: `world` equal slices of `output.numel()`
    elements; ranges may differ in length or be empty, comm/uneven.py). `output` may be this rank's own
    slice of `input`. Nothing is written to `output` before `finish()`; `input` must stay unchanged
    until then.
    """
    ranges = ranges if ranges is not None else _even(output.numel(), world)
    lo, hi = ranges[rank]
    peers = [r for r in range(world) if r != rank]
    received = torch.empty(len(peers), hi - lo, dtype=input.dtype, device=input.device)
    advise_huge_pages(received)  # half a unit's gradient at 2 ranks, written once: [Note: huge pages for unit buffers]
    works = []
    for k, peer in enumerate(peers):  # every rank knows every range, so both ends skip the same empty ones
        a, b = ranges[peer]
        if b > a:
            works.append(dist.isend(input[a:b], group=group, group_dst=peer, tag=_TAG))
        if hi > lo:
            works.append(dist.irecv(received[k], group=group, group_src=peer, tag=_TAG))

    def finish() -> None:
        own = input[lo:hi]
        if output.data_ptr() != own.data_ptr():
            output.copy_(own)
        for k in range(len(peers)):  # own slice first, then the peers' in rank order
            output.add_(received[k])

    return Works(works), finish


def exchange_all_gather(output: torch.Tensor, input: torch.Tensor, group, rank: int, world: int,
                        ranges: Optional[Sequence[tuple[int, int]]] = None) -> Works:
    """Start the exchange; after `wait()`, `output[ranges[r]]` holds rank r's `input` for every r
    (default ranges: equal rows in rank order; they may differ in length or be empty).

    `input` may be this rank's own range of `output` (it is only read); other ranges are written.
    """
    ranges = ranges if ranges is not None else _even(input.numel(), world)
    lo, hi = ranges[rank]
    works = []
    for peer in range(world):
        a, b = ranges[peer]
        if peer != rank:
            if hi > lo:
                works.append(dist.isend(input, group=group, group_dst=peer, tag=_GATHER_TAG))
            if b > a:
                works.append(dist.irecv(output[a:b], group=group, group_src=peer, tag=_GATHER_TAG))
    if hi > lo and output[lo:hi].data_ptr() != input.data_ptr():
        output[lo:hi].copy_(input)
    return Works(works)
