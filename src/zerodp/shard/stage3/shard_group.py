"""Where stage-3 collectives run: the shard group (its ranks, two communicators, CUDA streams).

Every flat unit of one model is sharded over the same `ShardGroup`. It owns no tensors; it issues
the two collectives of stage 3 and returns handles whose `wait()` makes the result usable:
    unshard:  all-gather every rank's shard into the unit's gathered buffer (allocating it)
    reduce:   reduce-scatter the unit's full gradient, leaving this rank's slice (summed)
and it counts the elements of gathered buffers alive right now (`live_numel`, `peak_live_numel`).

[Note: two communicators]
Gathers are issued at module-level events (a unit's forward, its backward, prefetch), in an order
every rank reproduces as long as every rank runs the same modules. A reduction is launched when a
unit's last gradient arrives, a parameter-level event: a rank whose batch leaves one parameter
unused completes that unit later than the others. On a single communicator the two kinds would then
interleave differently on different ranks, and the i-th collective of one rank would meet another
collective on the next rank (a hang, or silently mixed tensors). So reductions run on a second
communicator over the same ranks (`reduce_group`), issued strictly in the unit order fixed at the
start of each backward (see Stage3Sharding._launch_ready and [Note: collective order] in
grads/reduce_queue.py); gathers and the small control collectives stay on the engine's group.

[Note: CUDA streams]
On CUDA, gathers run on `gather_stream` and reductions on `reduce_stream`, so they overlap compute:
- a gather first makes its stream wait for the compute stream (the shard was last written there
  by the optimizer), allocates the gathered buffer *on the gather stream* and records an event;
  `wait()` makes the consuming stream wait for that event and calls `record_stream` on the buffer,
  so that when the unit is resharded (storage freed on the host, at once) the caching allocator
  does not hand the bytes to anyone before the consuming stream has finished reading them;
- a reduction makes its stream wait for the compute stream (gradients were accumulated there), and
  the full gradient buffer, allocated on the compute stream, is `record_stream`-ed on the reduce
  stream for the same reason; `wait()` makes the consuming stream wait for the reduction's event.
On CPU (gloo) the collectives are plain asynchronous work handles.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Optional

import torch

from ... import comm
from ...comm.quantized import all_gather_quantized, reduce_scatter_quantized
from ...host_memory import alloc_storage
from ..grads.reduce_queue import control_device
from .gather_ledger import GatherLedger
from .hpz import SecondaryGroup
from .mics import ReplicatedShards, all_gather_in_two_hops, close_replicated_shards


class _StreamHandle:
    """A collective queued on a side stream: `wait()` orders the current stream after it."""

    def __init__(self, event: "torch.cuda.Event", consumed: Optional[torch.Tensor]) -> None:
        self._event, self._consumed, self._done = event, consumed, False

    def wait(self) -> None:
        if self._done:
            return
        current = torch.cuda.current_stream()
        current.wait_event(self._event)
        if self._consumed is not None:
            # allocated on the gather stream, read on `current`: see [Note: CUDA streams]
            self._consumed.record_stream(current)
        self._done = True


class UnitReduction:
    """The collective that sums one flat unit's gradient over the shard group (`ShardGroup.reduce_scatter` on its
    reduce communicator and stream), passed down to the unit's gradient shard as the `reduce` it calls
    (grads/grad_shard.py `ReduceFn`), as stage 0-2 buckets pass a `grads.grad_arithmetic.GradCollective`: the
    shard calls the shard group, nothing calls back up into the flat unit."""

    def __init__(self, shards: "ShardGroup", what: str, ranges=None) -> None:
        self.shards, self.what, self.ranges = shards, what, ranges

    def __call__(self, output: torch.Tensor, full: torch.Tensor, async_op: bool):
        # always asynchronous on the reduce communicator (its own stream on CUDA): `async_op` is the caller's default
        return self.shards.reduce_scatter(output, full, what=self.what, ranges=self.ranges)


def _closer(ref: "weakref.ref[ShardGroup]"):
    def close_at_exit() -> None:
        shards = ref()
        if shards is not None:
            shards.close()
    return close_at_exit


class ShardGroup:
    """The ranks a model's units are sharded over, and where their collectives run."""

    def __init__(self, process_group: comm.ProcessGroup, device: torch.device, use_all_reduce: bool = False,
                 quantized_weights: bool = False, quantized_gradients: bool = False,
                 secondary: Optional[SecondaryGroup] = None, replicated: Optional[ReplicatedShards] = None) -> None:
        self.device = device  # where its units' shards and gathered buffers live
        # every rank of the job: what ranks agree on (grads/reduce_queue.py's control collective), write-backs
        self.control_group = process_group
        self.replicated = replicated  # MiCS/HSDP: shards inside a block, replicated across blocks (mics.py), or None
        # the ranks a unit is sharded over (all of them, or this rank's MiCS block): gathers
        self.process_group = process_group if replicated is None else replicated.shard_group
        self.data_parallel_world = comm.get_world_size(process_group)  # gradients are averaged over every rank
        self.secondary = secondary  # hpZ: the block that shares secondary shards (hpz.py), or None
        self.use_all_reduce = use_all_reduce  # DeepSpeed's reduce_scatter=false
        # ZeRO++ qwZ / qgZ (comm/quantized.py): approximations the user asked for, on sharded units' gathers
        # and reductions (persistent units gather their updated shards exactly, after the step)
        self.quantized_weights, self.quantized_gradients = quantized_weights, quantized_gradients
        self.rank = comm.get_rank(self.process_group)
        self.world = comm.get_world_size(self.process_group)
        # see [Note: two communicators]
        self.reduce_group = comm.new_group_like(process_group) if replicated is None else replicated.reduce_group
        # A backstop for entry points that never close the engine (a Trainer keeps it to the end): the group is
        # destroyed before interpreter shutdown, not by C++ static destructors ([Note: teardown] in comm).
        self._close_at_exit = _closer(weakref.ref(self))
        atexit.register(self._close_at_exit)
        self.gather_stream = self.reduce_stream = None
        if device.type == "cuda" and torch.cuda.is_available():
            self.gather_stream = torch.cuda.Stream(device)
            self.reduce_stream = torch.cuda.Stream(device)
        self.gather_wait_s = 0.0  # seconds the host has blocked waiting for gathers (profiling, the offload bench)
        self.live_numel = 0       # elements of gathered buffers allocated right now (persistent units excluded)
        self.peak_live_numel = 0
        # every gather issued on this group, checked to match on every rank ([Note: mixed gathers])
        self.ledger = GatherLedger(self.control_group, control_device(self.control_group, device))

    def unshard(self, full: torch.Tensor, shard: torch.Tensor, what: str = "", ranges=None, secondary: bool = False):
        """Allocate `full` and all-gather every rank's `shard` into it; returns a handle to wait on.
        `ranges`: each rank's range of `full` where shards differ in size (None: equal shards).
        `secondary`: `shard` is a secondary shard, gathered inside the hpZ block ([Note: secondary shards])."""
        self.live_numel += full.numel()
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)
        if self.gather_stream is None:
            alloc_storage(full, full.numel())
            return self._all_gather(full, shard, ranges, async_op=True, what=what, secondary=secondary)
        stream = self.gather_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            alloc_storage(full, full.numel())  # memory from the gather stream's pool
            # NCCL queues the op after `stream` and makes `stream` wait for it; the host does not block
            self._all_gather(full, shard, ranges, async_op=False, what=what, secondary=secondary)
            event = stream.record_event()
        return _StreamHandle(event, consumed=full)

    def _all_gather(self, full, shard, ranges, async_op: bool, what: str, secondary: bool = False):
        if secondary:  # exact, inside the block: only the primary gather crosses nodes, so only it is quantized
            return comm.all_gather(full, shard, self.secondary.process_group, async_op=async_op, tag="param",
                                   what=what)
        if ranges is None and self.replicated is not None and self.replicated.two_hops is not None:
            return all_gather_in_two_hops(full, shard, self.replicated.two_hops, async_op, what)
        if ranges is None and self.quantized_weights:
            return all_gather_quantized(full, shard, self.process_group, async_op=async_op, tag="param", what=what)
        if ranges is None:
            return comm.all_gather(full, shard, self.process_group, async_op=async_op, tag="param", what=what)
        return comm.all_gather_uneven(full, shard, ranges, self.process_group, async_op=async_op, tag="param",
                                      what=what)

    def _reduce_scatter(self, output, full, ranges, async_op: bool, what: str):
        if ranges is None and self.quantized_gradients:
            return reduce_scatter_quantized(output, full, self.reduce_group, async_op=async_op, tag="grad", what=what)
        if ranges is None:
            return comm.reduce_scatter(output, full, self.reduce_group, async_op=async_op, tag="grad",
                                       use_all_reduce=self.use_all_reduce, what=what)
        return comm.reduce_scatter_uneven(output, full, ranges, self.reduce_group, async_op=async_op, tag="grad",
                                          use_all_reduce=self.use_all_reduce, what=what)

    def on_resharded(self, full: torch.Tensor) -> None:
        """Account for a gathered buffer whose storage was just released."""
        self.live_numel -= full.numel()

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, what: str = "", ranges=None):
        """Sum `full` over ranks into this rank's slice `output`; returns a handle to wait on.
        `ranges`: as in `unshard`."""
        if self.reduce_stream is None:
            handle = self._reduce_scatter(output, full, ranges, async_op=True, what=what)
            if self.replicated is None or self.replicated.replicate_group is None:
                return handle
            return comm.Handle(None, lambda: (handle.wait(), self._reduce_replicas(output, what)))
        stream = self.reduce_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._reduce_scatter(output, full, ranges, async_op=False, what=what)
            if self.replicated is not None and self.replicated.replicate_group is not None:
                self._reduce_replicas(output, what)
            event = stream.record_event()
        full.record_stream(stream)  # allocated on the compute stream, read on this one
        return _StreamHandle(event, consumed=None)

    def _reduce_replicas(self, output: torch.Tensor, what: str) -> None:
        """MiCS/HSDP: sum the block's reduced slice over the replicas ([Note: replicated shards]). Blocking,
        in the reductions' order (the same on every rank), on its own communicator."""
        comm.all_reduce(output, self.replicated.replicate_group, tag="grad", what=what)

    def close(self) -> None:
        """Destroy the communicators this group made (idempotent); see comm.destroy_group."""
        atexit.unregister(self._close_at_exit)
        if self.replicated is not None:
            replicated, self.replicated = self.replicated, None
            self.reduce_group = self.process_group
            close_replicated_shards(replicated)
        group, self.reduce_group = self.reduce_group, self.process_group
        comm.destroy_group(group, made_from=self.process_group)
        if self.secondary is not None:
            block, self.secondary = self.secondary.process_group, None
            comm.destroy_group(block, made_from=self.process_group)

    def sync_all(self) -> None:
        """Make the current stream wait for every side-stream collective (CUDA; no-op on CPU)."""
        if self.gather_stream is not None:
            torch.cuda.current_stream().wait_stream(self.gather_stream)
            torch.cuda.current_stream().wait_stream(self.reduce_stream)
