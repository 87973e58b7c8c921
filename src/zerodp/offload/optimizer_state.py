"""The optimizer state of an offloaded run, streamed through the step one window at a time.

The inner (user's) optimizer steps chunk tensors (see [Note: optimizer chunks] in optimizer.py). Here
their elementwise state (Adam's exp_avg and exp_avg_sq, SGD's momentum_buffer, ...) lives in a store
(host memory or files) and is in `optimizer.state` only while its chunks are stepped; scalars such as
Adam's `step` stay resident. This rank's chunks, concatenated, form one stream of `numel` elements,
cut into windows of whole chunks, at most `window_numel` (zero_optimization.sub_group_size) elements
unless one chunk alone is larger (see `chunk_numel`).

[Note: offload pipeline] For window i the step does, with a pool of `buffer_count` I/O slots:
    read window i+1  ||  step window i  ||  write window i-1
so RAM holds at most buffer_count windows of state. The arithmetic is the inner optimizer's own, on
the same chunks with the same values, so the result is bitwise the same as without offload.
A window whose chunks never stepped has nothing to read: the optimizer creates its state (zeros),
which is then written like any other.

[Note: whole-tensor chunks] A whole-tensor group's chunks (Muon, Adafactor: [Note: whole-tensor
units] in optimizer.py) are whole parameters, shaped like them, and may be larger than a window:
such a window holds that one chunk, and the I/O slots are sized for the largest window. Stepping
a window of whole parameters is stepping those parameters, which such an optimizer does one at a
time anyway. What streams is the state shaped like its chunk (Muon's momentum buffer, Adafactor's
second moment of a vector); state of another shape (Adafactor's row and column moments of a
matrix, a few elements per row and column) and scalars stay resident in `optimizer.state`.
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Callable, NamedTuple, Optional

import torch

from .file_io import IOHandle


class Window(NamedTuple):
    """Consecutive chunks [first, last) of the stream, elements [start, start + numel)."""

    first: int
    last: int
    start: int
    numel: int


def plan_windows(chunk_numels: list[int], window_numel: int) -> list[Window]:
    """Group consecutive chunks into windows of at most window_numel elements (at least one chunk each)."""
    windows, first, start, numel = [], 0, 0, 0
    for i, n in enumerate(chunk_numels):
        if numel and numel + n > window_numel:
            windows.append(Window(first, i, start, numel))
            first, start, numel = i, start + numel, 0
        numel += n
    if numel:
        windows.append(Window(first, len(chunk_numels), start, numel))
    return windows


def _elementwise(state: dict, chunk: torch.Tensor) -> list[str]:
    return [k for k, v in state.items() if torch.is_tensor(v) and v.shape == chunk.shape and v.dim() > 0]


class OffloadedOptimizerState:
    """Owns the stored elementwise state of every chunk; see the module docstring."""

    def __init__(self, window_numel: int, buffer_count: int, make_stores: Callable[[int], list],
                 host_fraction: float = 0.0, pin_memory: bool = False, owned: tuple = ()) -> None:
        self.window_numel = window_numel
        self.buffer_count = buffer_count
        self.make_stores = make_stores   # numel -> [host store, file store] (either may be None)
        self.host_fraction = host_fraction
        self.pin_memory = pin_memory
        self.owned = owned               # closed with this object (the I/O pool, the rank's folder)
        self.optimizer = None
        self.read_wait_s = 0.0           # time the step was blocked on reads / writes
        self.write_wait_s = 0.0

    def chunk_numel(self, default: int) -> int:
        """Chunk size for the optimizer: the same as without offload, whatever the window. A window
        smaller than a chunk holds that one chunk (slots are sized for the largest window). Chunking
        the same way matters: torch's fused CPU AdamW rounds the last elements of each tensor (its
        vector loop's tail) differently, so other chunks would change the last bits of the result."""
        return default

    # -- binding -------------------------------------------------------------------------------

    def attach(self, optimizer, chunks: list[list[torch.Tensor]]) -> None:
        """Take over the state of `optimizer`'s chunks (one list per master); evicts any state it has."""
        self.optimizer = optimizer
        self.chunks = [c for per_master in chunks for c in per_master]
        self.index = {id(c): i for i, c in enumerate(self.chunks)}
        numels = [c.numel() for c in self.chunks]
        self.offsets = [0]
        for n in numels:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1]
        self.windows = plan_windows(numels, self.window_numel)
        # a whole-tensor chunk larger than window_numel is a window alone: see [Note: whole-tensor chunks]
        self.slot_numel = max((w.numel for w in self.windows), default=0)
        host_windows = sum(1 for w in self.windows if w.start + w.numel <= self.host_fraction * self.numel)
        self.host_numel = self.windows[host_windows - 1].start + self.windows[host_windows - 1].numel \
            if host_windows else 0
        self.host_store, self.file_store = self.make_stores(self.host_numel, self.numel - self.host_numel)
        self.keys: dict[str, torch.dtype] = {}      # elementwise state names, in first-seen order
        self.stored: list[tuple[str, ...]] = [()] * len(self.chunks)  # keys held in the store, per chunk
        self._slots: list[dict] = []
        self._free: list[dict] = []
        with self.resident(list(range(len(self.chunks)))):
            pass  # e.g. Adagrad creates its state in the constructor: move it to the store now

    def _store_of(self, window: Window):
        if window.start < self.host_numel:
            return self.host_store, window.start
        return self.file_store, window.start - self.host_numel

    # -- I/O slots -----------------------------------------------------------------------------

    def _slot(self, pending: collections.deque) -> dict:
        if self._free:
            return self._free.pop()
        if len(self._slots) < self.buffer_count:
            slot = {k: torch.empty(self.slot_numel, dtype=d, pin_memory=self.pin_memory)
                    for k, d in self.keys.items()}
            self._slots.append(slot)
            return slot
        while pending:  # the oldest write that holds a slot frees it (host windows hold none)
            handles, slot = pending.popleft()
            self._wait(handles, "write")
            if slot is not None:
                return slot
        raise AssertionError("every offload I/O slot is held by a read; buffer_count is too small for the pipeline")

    def _ensure_key(self, key: str, dtype: torch.dtype) -> None:
        if key in self.keys:
            return
        self.keys[key] = dtype
        for store in (self.host_store, self.file_store):
            if store is not None:
                store.ensure(key, dtype)
        for slot in self._slots:
            slot[key] = torch.empty(self.slot_numel, dtype=dtype, pin_memory=self.pin_memory)

    # -- one window ----------------------------------------------------------------------------

    def _read(self, window: Window, pending: collections.deque):
        """Start reading `window`'s state; returns (handles, slot, buffers by key)."""
        store, offset = self._store_of(window)
        slot = None if store.is_host else self._slot(pending)
        buffers = {k: store.buffer(k, offset, window.numel, slot) for k in self.keys}
        handles: list[IOHandle] = []
        if any(self.stored[window.first:window.last]):
            handles = [store.read(k, offset, buf) for k, buf in buffers.items()]
        return handles, slot, buffers

    def _install(self, window: Window, buffers: dict) -> None:
        for i in range(window.first, window.last):
            if not self.stored[i]:
                continue
            chunk = self.chunks[i]
            lo = self.offsets[i] - window.start
            state = self.optimizer.state[chunk]
            for k in self.stored[i]:
                state[k] = buffers[k][lo:lo + chunk.numel()].view(chunk.shape)

    def _evict(self, window: Window, buffers: dict, slot: Optional[dict]) -> list[IOHandle]:
        """Move the window's elementwise state into its buffers, drop it from the optimizer, start the writes."""
        store, offset = self._store_of(window)
        for i in range(window.first, window.last):
            chunk = self.chunks[i]
            state = self.optimizer.state.get(chunk, {})
            keys = _elementwise(state, chunk)
            for k in keys:
                self._ensure_key(k, state[k].dtype)
                if k not in buffers:  # a state the optimizer created in this step
                    buffers[k] = store.buffer(k, offset, window.numel, slot)
                lo = self.offsets[i] - window.start
                target = buffers[k][lo:lo + chunk.numel()]
                if target.data_ptr() != state[k].data_ptr():
                    target.copy_(state[k].reshape(-1))  # state the optimizer just created (or a checkpoint's)
                del state[k]
            self.stored[i] = tuple(keys)
        return [store.write(k, offset, buf) for k, buf in buffers.items()]

    # -- the step ------------------------------------------------------------------------------

    def step(self, step_window: Callable[[list[torch.Tensor]], None]) -> None:
        """Run `step_window(chunks)` for every window, with its state resident; see [Note: offload pipeline]."""
        pending: collections.deque = collections.deque()   # (write handles, slot) in issue order
        prefetch = self.buffer_count >= 2
        next_read = self._read(self.windows[0], pending) if self.windows else None
        for n, window in enumerate(self.windows):
            handles, slot, buffers = next_read
            next_read = None
            if prefetch and n + 1 < len(self.windows):
                next_read = self._read(self.windows[n + 1], pending)  # read i+1 while stepping i
            self._wait(handles, "read")
            self._install(window, buffers)
            step_window(self.chunks[window.first:window.last])
            pending.append((self._evict(window, buffers, slot), slot))
            if next_read is None and n + 1 < len(self.windows):
                next_read = self._read(self.windows[n + 1], pending)
        self._drain(pending)

    def _drain(self, pending: collections.deque) -> None:
        while pending:
            handles, slot = pending.popleft()
            self._wait(handles, "write")
            if slot is not None:
                self._free.append(slot)

    def _wait(self, handles: list[IOHandle], kind: str) -> None:
        """Wait for `handles`, adding the time blocked to read_wait_s or write_wait_s (the bench's split)."""
        start = time.perf_counter()
        for h in handles:
            h.wait()
        if kind == "read":
            self.read_wait_s += time.perf_counter() - start
        else:
            self.write_wait_s += time.perf_counter() - start

    @contextlib.contextmanager
    def resident(self, chunk_indices: list[int], read: bool = True, write: bool = True):
        """Hold the state of these chunks in `optimizer.state` for the block (checkpoints read and
        replace it there), then store it again. Reads and writes synchronously, chunk by chunk.

        `read=False`: the block replaces the state without looking at it (a load), so nothing is read.
        `write=False`: the block only reads it (a save), so it is dropped, not written back."""
        for i in chunk_indices if read else ():
            chunk, window = self.chunks[i], self._chunk_window(i)
            store, offset = self._store_of(window)
            offset += self.offsets[i] - window.start
            for k in self.stored[i]:
                t = torch.empty(chunk.numel(), dtype=self.keys[k])
                store.read(k, offset, t).wait()
                self.optimizer.state[chunk][k] = t.view(chunk.shape)
        try:
            yield
        finally:
            for i in chunk_indices:
                chunk, window = self.chunks[i], self._chunk_window(i)
                store, offset = self._store_of(window)
                offset += self.offsets[i] - window.start
                state = self.optimizer.state.get(chunk, {})
                keys = _elementwise(state, chunk)
                for k in keys:
                    if write:
                        self._ensure_key(k, state[k].dtype)
                        store.write(k, offset, state[k].reshape(-1).contiguous()).wait()
                    del state[k]
                if write:
                    self.stored[i] = tuple(keys)

    def stored_dtypes(self, chunk_index: int) -> dict[str, torch.dtype]:
        """The elementwise state keys of a chunk held in the store, with their dtypes (nothing is read)."""
        return {k: self.keys[k] for k in self.stored[chunk_index]}

    def chunk_indices(self, chunks: list[torch.Tensor]) -> list[int]:
        return [self.index[id(c)] for c in chunks]

    def _chunk_window(self, i: int) -> Window:
        return next(w for w in self.windows if w.first <= i < w.last)

    # -- accounting ----------------------------------------------------------------------------

    def host_bytes(self) -> int:
        """Host memory of the stored state and of the I/O slots."""
        slots = sum(t.numel() * t.element_size() for s in self._slots for t in s.values())
        return slots + (self.host_store.host_bytes() if self.host_store is not None else 0)

    def disk_bytes(self) -> int:
        return self.file_store.disk_bytes() if self.file_store is not None else 0

    def close(self) -> None:
        for store in (self.host_store, self.file_store):
            if store is not None:
                store.close()
        self._slots.clear()
        self._free.clear()
        for resource in self.owned:
            resource.close()
