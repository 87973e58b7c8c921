"""The collectives zerodp uses, as functions returning handles. Backend differences live here only.

Every function takes the process group explicitly (`None` means the default group) and works with
no process group at all (one process): then collectives are identities. Each call is appended to
the active `record()` logs, so tests (and users) can count what a step moves.

With one rank collectives are identities unless real collectives are switched on (group.py,
[Note: collectives at world size 1]).

Backend choices: on gloo (2 ranks or more) `reduce_scatter` and `all_gather` are direct pairwise
exchanges (pairwise.py: gloo's own reduce-scatter is a slow blocking composite, its all-gather copies
through staging buffers); gloo refuses uneven all-gathers, so every caller passes buffers padded by
`partition.FlatLayout`.

Every collective is entered in the flight recorder and every wait runs under the watchdog
(`watchdog.py`): a wait longer than comm_timeout_s prints what this rank was doing and exits. Where a
wait does not block the host (NCCL: it only orders the current CUDA stream after the collective), the
watchdog polls a CUDA event recorded behind it instead ([Note: waits that do not block the host]).
`what` names the collective's target (e.g. a stage-3 unit) for those reports and for debug_sync.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ..errors import DivergenceError
from . import process_state, topology, watchdog
from .group import (ProcessGroup, backend_name, get_rank, get_world_size, is_initialized, issues_no_collectives,
                    wait_blocks_host)
from .pairwise import exchange_all_gather, exchange_reduce_scatter

# torch 2.13 renamed the tensor-form collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def chunk_ranges(numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """Split [0, numel) into consecutive ranges of at most `chunk_numel` elements (a long message as
    several bounded ones: staging buffers stay small)."""
    if chunk_numel < 1:
        raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
    return [(s, min(s + chunk_numel, numel)) for s in range(0, numel, chunk_numel)]


@dataclass(frozen=True)
class CommRecord:
    """One collective call: the logical operation, how it was carried out, and its size."""

    op: str            # all_reduce | reduce_scatter | all_gather | all_to_all | broadcast
    impl: str          # the torch collective actually issued
    numel: int         # elements of the full buffer (reduce input, gather output)
    dtype: torch.dtype
    tag: str = ""      # who issued it ("grad", "param", "norm", ...)
    crosses_nodes: bool = False  # its group has ranks on more than one node (comm/topology.py)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def volume_bytes(self) -> int:
        """The ZeRO paper's communication volume of this call: the buffer's bytes, twice for an all-reduce
        (a reduce-scatter plus an all-gather), so that stage 3's step is 3 Psi and DDP's 2 Psi."""
        return self.nbytes * (2 if self.op == "all_reduce" else 1)


@dataclass
class CommLog:
    """The records of every collective issued while a `record()` block is active."""

    records: list[CommRecord] = field(default_factory=list)

    def of(self, op: str, tag: Optional[str] = None) -> list[CommRecord]:
        return [r for r in self.records if r.op == op and (tag is None or r.tag == tag)]

    def numel(self, op: str, tag: Optional[str] = None) -> int:
        return sum(r.numel for r in self.of(op, tag))

    def volume_bytes(self, crosses_nodes: Optional[bool] = None) -> int:
        """Total `CommRecord.volume_bytes`: of every call, or only of inter-node (True) / intra-node (False) ones."""
        return sum(r.volume_bytes for r in self.records if crosses_nodes is None or r.crosses_nodes == crosses_nodes)


# The open `record()` logs (a debugging aid, not configuration) and the observers of every collective
# (monitor/comms_logger.py) live in the Runtime's CommState (process_state.py): `logs`, `observers`. An observer's
# `issued(record, entry, skipped)` is called as each collective is issued; its flight-recorder entry gets `done_at`
# when the host wait returns. Empty unless a comms_logger is enabled, so the cost when off is one list check per
# collective. Under a comms_logger on CUDA, waits also synchronize the device (`sync_device_on_wait`) so that
# done_at is when the collective finished, not when it was queued (a sync point, only while profiling).


def _state() -> process_state.CommState:
    return process_state.installed or process_state.current()  # current() raises where none is installed


def add_observer(observer, sync_device_on_wait: bool = False) -> None:
    """Call `observer.issued(record, entry, skipped)` for every collective until `remove_observer`."""
    state = _state()
    state.observers.append(observer)
    state.sync_device_on_wait = state.sync_device_on_wait or sync_device_on_wait


def remove_observer(observer) -> None:
    state = _state()
    if observer in state.observers:
        state.observers.remove(observer)
    state.sync_device_on_wait = state.sync_device_on_wait and bool(state.observers)


def observers() -> list:
    """The observers of every collective now (a copy)."""
    return list(_state().observers)


def _device_done() -> None:
    if _state().sync_device_on_wait and torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def record() -> Iterator[CommLog]:
    """Record every collective issued inside the block (nesting allowed)."""
    log, logs = CommLog(), _state().logs
    logs.append(log)
    try:
        yield log
    finally:
        logs.remove(log)


def _log(op: str, impl: str, tensor: torch.Tensor, tag: str, group: ProcessGroup = None,
         what: str = "") -> watchdog.Entry:
    """Record a collective (record() logs, flight recorder); under debug_sync, check ranks agree first."""
    state = _state()
    if state.logs or state.observers:
        rec = CommRecord(op, impl, tensor.numel(), tensor.dtype, tag, topology.crosses_nodes(group))
    for log in state.logs:
        log.records.append(rec)
    entry = watchdog.issue(op, tag, tensor.numel(), tensor.dtype, _group_name(group), what)
    if state.observers:
        skipped = issues_no_collectives(group)
        if skipped:
            entry.done_at = entry.issued_at  # an identity: nothing to wait for
        for observer in state.observers:
            observer.issued(rec, entry, skipped)
    if watchdog.debug_sync_enabled() and not issues_no_collectives(group):
        _check_same_collective(entry, group)
    return entry


def _group_name(group: ProcessGroup) -> str:
    return "world" if group is None else str(getattr(group, "group_name", "?"))


def _check_same_collective(entry: watchdog.Entry, group: ProcessGroup) -> None:
    """debug_sync: exchange a hash of the collective about to be issued; refuse on any mismatch."""
    world = get_world_size(group)
    mine = torch.tensor([watchdog.signature(entry)], dtype=torch.int64, device=_device_for(group))
    every = torch.empty(world, dtype=torch.int64, device=mine.device)
    _finish(_all_gather_single(every, mine, group=group, async_op=True), None, False, entry, group)
    if bool((every == every[0]).all()):
        return
    descriptions = [None] * world
    with watchdog.waiting(entry):
        dist.all_gather_object(descriptions, entry.describe(), group=group)
    lines = "\n".join(f"  rank {r}: {d}" for r, d in enumerate(descriptions))
    raise DivergenceError(f"debug_sync: ranks are about to issue different collectives:\n{lines}\n"
                                   f"Every rank must run the same modules in the same order.")


class Handle:
    """A pending collective. `wait()` blocks until it is done (or, on NCCL, orders the current stream after
    it) and runs its completion step once."""

    def __init__(self, work: Optional[dist.Work] = None, then: Optional[Callable[[], None]] = None,
                 entry: Optional[watchdog.Entry] = None, blocks_host: bool = True) -> None:
        self._work, self._then, self._done, self._entry = work, then, False, entry
        self._blocks_host = blocks_host

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            with watchdog.waiting(self._entry):
                self._work.wait()
                _device_done()
            if not self._blocks_host and self._entry is not None:
                watchdog.track(self._entry, _stream_probe())
        if self._then is not None:
            self._then()
        self._done = True

    @property
    def done(self) -> bool:
        return self._done


def _stream_probe() -> Callable[[], bool]:
    """A CUDA event recorded on the current stream, which a wait just ordered after a collective: its
    `query` turns true when the collective (and the work queued before it) is done."""
    event = torch.cuda.Event()
    event.record()
    return event.query


def _finish(work: Optional[dist.Work], then: Optional[Callable[[], None]], async_op: bool,
            entry: watchdog.Entry, group: ProcessGroup) -> Handle:
    # Collectives are always issued asynchronously and a blocking one is waited on here, so that
    # every wait runs under the watchdog.
    handle = Handle(work, then, entry, wait_blocks_host(backend_name(group)))
    if not async_op:
        handle.wait()
    return handle


def all_reduce(tensor: torch.Tensor, group: ProcessGroup = None, *, async_op: bool = False,
               op: dist.ReduceOp = dist.ReduceOp.SUM, tag: str = "", what: str = "") -> Handle:
    """Sum (or `op`) `tensor` in place across the group."""
    entry = _log("all_reduce", "all_reduce", tensor, tag, group, what)
    if issues_no_collectives(group):
        return Handle()
    return _finish(dist.all_reduce(tensor, op=op, group=group, async_op=True), None, async_op, entry, group)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup = None, *,
                   async_op: bool = False, use_all_reduce: bool = False, tag: str = "", what: str = "") -> Handle:
    """Sum `input` across the group and leave this rank's 1/N slice in `output`.

    `input` must be padded to a multiple of the group size; its contents are undefined afterwards
    (it may hold the full sum). `use_all_reduce` forces the all-reduce form (DeepSpeed's
    `reduce_scatter: false`); gloo exchanges slices pairwise (see the module note).
    """
    world = get_world_size(group)
    if input.numel() != output.numel() * world:
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected {world} x "
                         f"{output.numel()} (pad the buffer to a multiple of the group size)")
    if issues_no_collectives(group):
        _log("reduce_scatter", "none", input, tag, group, what)
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Handle()
    if not use_all_reduce and backend_name(group) == "gloo" and world > 1:
        entry = _log("reduce_scatter", "pairwise", input, tag, group, what)
        work, finish = exchange_reduce_scatter(output, input, group, get_rank(group), world)
        return _finish(work, finish, async_op, entry, group)
    if use_all_reduce or backend_name(group) == "gloo":  # one gloo rank: a real call (tests/gpu's path)
        entry = _log("reduce_scatter", "all_reduce", input, tag, group, what)
        lo = get_rank(group) * output.numel()
        mine = input[lo:lo + output.numel()]

        def keep_slice() -> None:
            if output.data_ptr() != mine.data_ptr():
                output.copy_(mine)

        work = dist.all_reduce(input, group=group, async_op=True)
        return _finish(work, keep_slice, async_op, entry, group)
    entry = _log("reduce_scatter", "reduce_scatter_single", input, tag, group, what)
    return _finish(_reduce_scatter_single(output, input, group=group, async_op=True), None, async_op, entry, group)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup = None, *, async_op: bool = False,
               tag: str = "", what: str = "") -> Handle:
    """Send the r-th of N equal slices of `input` to rank r; receive rank r's slice for us in `output`'s r-th."""
    if input.numel() != output.numel() or input.numel() % get_world_size(group):
        raise ValueError(f"all_to_all: input ({input.numel()}) and output ({output.numel()}) must be equal "
                         f"multiples of the group size")
    entry = _log("all_to_all", "all_to_all_single", input, tag, group, what)
    if issues_no_collectives(group):
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Handle()
    return _finish(dist.all_to_all_single(output, input, group=group, async_op=True), None, async_op, entry, group)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup = None, *,
               async_op: bool = False, tag: str = "", max_message_numel: Optional[int] = None,
               what: str = "") -> Handle:
    """Concatenate every rank's `input` (equal sizes) into `output`, in rank order.

    `input` may be this rank's own slice of `output` (the usual in-place form). A gather larger than
    `max_message_numel` elements is sent as several messages through a small staging buffer; that path
    completes before returning.
    """
    world = get_world_size(group)
    if output.numel() != input.numel() * world:
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected {world} x {input.numel()}")
    if issues_no_collectives(group):
        _log("all_gather", "all_gather_single", output, tag, group, what)
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Handle()
    limit = max_message_numel or output.numel()
    if output.numel() > limit:
        _chunked_all_gather(output, input, group, max(1, limit // world), tag, what)
        return Handle()
    if backend_name(group) == "gloo" and world > 1:
        entry = _log("all_gather", "pairwise", output, tag, group, what)
        return _finish(exchange_all_gather(output, input, group, get_rank(group), world), None, async_op, entry, group)
    entry = _log("all_gather", "all_gather_single", output, tag, group, what)
    if backend_name(group) != "nccl" and _overlaps(output, input):
        # NCCL documents the in-place form; for other backends send a private copy to be safe.
        input = input.clone()
    return _finish(_all_gather_single(output, input, group=group, async_op=True), None, async_op, entry, group)


def _chunked_all_gather(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup, per_rank: int,
                        tag: str, what: str) -> None:
    """All-gather `per_rank` elements of every rank's input at a time, then move them into place."""
    world, shard = get_world_size(group), input.numel()
    staging = torch.empty(world * min(per_rank, shard), dtype=output.dtype, device=output.device)
    rows = output.view(world, shard)
    for lo, hi in chunk_ranges(shard, per_rank):
        part = staging[:world * (hi - lo)]
        entry = _log("all_gather", "all_gather_single", part, tag, group, what)
        # input may alias a slice of output: the copy is sent before any row of output is written
        _finish(_all_gather_single(part, input[lo:hi].clone(), group=group, async_op=True), None, False, entry, group)
        rows[:, lo:hi].copy_(part.view(world, hi - lo))


def broadcast(tensor: torch.Tensor, src: int = 0, group: ProcessGroup = None, *, tag: str = "") -> None:
    """Copy rank `src`'s `tensor` to every rank (`src` is a rank of `group`)."""
    entry = _log("broadcast", "broadcast", tensor, tag, group)
    if issues_no_collectives(group):
        return
    global_src = dist.get_global_rank(group, src) if group is not None else src
    _finish(dist.broadcast(tensor, src=global_src, group=group, async_op=True), None, False, entry, group)


def all_gather_object(obj, group: ProcessGroup = None) -> list:
    """Every rank's picklable `obj`, in rank order (`[obj]` with no process group)."""
    world = get_world_size(group)
    if issues_no_collectives(group):
        return [obj]
    out = [None] * world
    entry = watchdog.issue("all_gather_object", "object", 1, "object", _group_name(group), "")
    with watchdog.waiting(entry):
        dist.all_gather_object(out, obj, group=group)  # note: a sync point
    return out


def all_reduce_max_flag(flag, group: ProcessGroup = None, *, tag: str = "") -> bool:
    """True on every rank if `flag` (a bool, or a bool tensor not yet read: one host read in all) is true on any
    rank (e.g. an fp16 overflow somewhere)."""
    device = _device_for(group)
    if isinstance(flag, torch.Tensor):
        t = flag.reshape(1).to(device=device, dtype=torch.float32)
    else:
        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32, device=device)
    all_reduce(t, group, op=dist.ReduceOp.MAX, tag=tag)
    return bool(t.item() > 0)  # note: a sync point


def _device_for(group: ProcessGroup) -> torch.device:
    if backend_name(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, a1 = a.data_ptr(), a.data_ptr() + a.numel() * a.element_size()
    b0, b1 = b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1
