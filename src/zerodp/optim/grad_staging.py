"""Reduced gradient shards copied into pinned host buffers as they become final: `GradStaging` (ZeRO-Offload).

When the optimizer steps on the host while the model computes on a GPU (`placement.Placement.steps_on_host`),
the step reads each unit's gradient shard from a host buffer (`Placement.grad_staging`: page-locked, the
master dtype). Copied at the step, the copies of every unit queue behind the whole backward and the host
waits for all of them at once. Here each unit's copy is queued the moment its shard holds its final value
for the step, while the backward goes on computing the next units:

    stage 1   at the accumulation boundary's reduce-scatter of the bucket (its only reduction)
    stage 2   at the boundary micro-step's reduction of the bucket (the last one adding into the shard)
    stage 3   at the boundary micro-step's reduction of the unit

The staging is the gradient shards' destination, chosen once from the placement when the engine is composed
(engine/grad_path.py gives each shard its `destination(index)`; the step plan reads the same staging).
`arm(final)` runs before every backward (final: it is the boundary's). While armed, every delivery of a
reduced slice into a shard (grads/grad_shard.py [Note: reduced shard destination]) queues a copy of the
whole shard on a side stream, ordered after the delivery by the stream's wait on the current one; the copy
is then "fresh". A shard delivered again in the same backward (a late gradient's second round) is copied
again: `before_write` makes the current stream wait for the copy in flight first, so the add never races
the read. A shard not delivered during the boundary's backward (a stage-3 unit no rank touched at the last
micro-step) is not fresh: `take` copies it at the step (`copy_now`), the path every shard took before.

`wait()` is the step's sync point: the host reads the buffers only after it. On a CPU (the forced path of
the tests, tests/unit/offload/test_placement.py) host and device are one memory: copies are plain and synchronous.

[Note: 16-bit copies, widened on the host] What is copied is the shard as reduced, in its own dtype (the
accumulation dtype: `Placement.grad_staging.dtype`, bf16 or fp16 in mixed precision unless
data_types.grad_accum_dtype says fp32), so the bus carries 2 bytes per element, not the 4 of a copy into an
fp32 buffer (which the GPU would convert first). The step reads fp32 (the masters' dtype): `wait()` widens
each copy on the host, exactly (every bf16/fp16 value is an fp32 value), into the buffer the step reads. No
second buffer: the copy lands in the last half of that fp32 buffer's bytes (`landing_view`) and is widened in
place from the front (`widen_in_place`), in blocks that never overlap the elements not yet read; torch refuses
an overlapping copy, so an error in that arithmetic raises instead of corrupting. Pinned host bytes per element
of the shard: 4, as before (one fp32 buffer per unit); bytes over the bus: 2 (was 4).

The loss-scale division and the clip multiplication are the step's, applied to the widened copy
(optim/step_plan.py `bind_all`): elementwise, correctly rounded IEEE operations on the same fp32 values, so the
host computes bitwise what the GPU would.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..offload.placement import Home


class GradStaging:
    """Pinned host copies of units' gradient shards, queued as each is delivered at the boundary (see above)."""

    def __init__(self, home: Home, device: torch.device, read_dtype: torch.dtype = torch.float32) -> None:
        self.home = home                      # what the copies carry (the shards' dtype) and where (pinned host)
        self.read_dtype = read_dtype          # what the step reads (the masters' dtype), widened on the host
        self.device = torch.device(device)    # where the shards live (the model's device)
        self.cuda = self.device.type == "cuda"
        self.armed = False                    # deliveries now are the step's final values
        # unit index -> the buffer the step reads (allocated once); the copies land in its last bytes
        self._buffers = HostBuffers(dataclasses.replace(home, dtype=read_dtype))
        self._events: dict[int, object] = {}          # unit index -> the event of its copy in flight (CUDA)
        self._fresh: set[int] = set()                 # units whose buffer holds the shard's final value
        self._taken: set[int] = set()                 # units the step reads: widened at `wait()`
        self._stream = None                           # the side stream of the copies (CUDA, made on first use)
        self.staged_copies = 0                        # copies queued at deliveries (tests read it)
        self.copied_bytes = 0                         # bytes the copies carried from the shards (tests read it)

    # -- during the backward ---------------------------------------------------------------------

    def arm(self, final: bool) -> None:
        """Before a backward: `final` when it is the accumulation boundary's (its deliveries are the step's)."""
        self.armed = final
        if final:
            self._fresh.clear()  # earlier copies (a previous backward at this boundary) may be stale now

    def destination(self, index: int) -> "HostCopyDestination":
        """Unit `index`'s gradient destination (grads/grad_destination.py), given to its shard once by the
        engine's composition (engine/grad_path.py: `GradShard.deliver_to`)."""
        return HostCopyDestination(self, index)

    def before_write(self, index: int) -> None:
        """A delivery is about to add into unit `index`'s shard: it must not overtake a copy of it in flight."""
        event = self._events.get(index)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def after_write(self, index: int, shard: torch.Tensor) -> None:
        """Unit `index`'s shard received a reduced slice; while armed, queue its copy to the host."""
        if not self.armed:
            return
        landing = self._landing(index, shard)
        if not self.cuda:  # one memory: a plain copy
            landing.copy_(shard)
        else:
            stream = self._side_stream()
            # the copy reads what the current stream has just written: order it after that, not after more
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                # device -> pinned host in the shard's own dtype: a DMA beside the backward's kernels
                landing.copy_(shard, non_blocking=True)
                event = self._events.get(index) or torch.cuda.Event()
                event.record(stream)
            self._events[index] = event
        self._fresh.add(index)
        self.staged_copies += 1

    # -- at the step -------------------------------------------------------------------------------

    def take(self, index: int, shard: torch.Tensor) -> torch.Tensor:
        """Unit `index`'s host copy of `shard`, in `read_dtype`: the one queued at its last delivery, or (none
        fresh) one queued now. Read it only after `wait()`, which widens it."""
        if index in self._fresh:
            self._taken.add(index)
            return self._buffers.get(index, shard.numel())
        return self.copy_now(index, shard)

    def copy_now(self, index: int, g: torch.Tensor) -> torch.Tensor:
        """Queue a copy of `g` into unit `index`'s buffer on the current stream; the buffer, in `read_dtype`,
        holds it after `wait()`."""
        buf = self._buffers.get(index, g.numel())
        self._landing(index, g).copy_(g, non_blocking=self.home.pinned)
        self._fresh.discard(index)  # the buffer no longer holds the copy made at the delivery
        self._taken.add(index)
        return buf

    def wait(self) -> None:
        """Wait for the copies the step takes and widen them on the host into the buffers it reads."""
        # note: a sync point. The copies return before they are done; the host optimizer must not read the
        # buffers earlier. The side stream's copies were queued during the backward and are mostly done.
        if self.cuda:
            if self._stream is not None:
                self._stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()  # the copies queued at the step (copy_now)
        for index in sorted(self._taken):  # [Note: 16-bit copies, widened on the host]
            buf = self._buffers.held(index)
            widen_in_place(buf, landing_view(buf, self.home.dtype))
        self._taken.clear()

    def settle(self) -> None:
        """After the step (taken or skipped): forget the copies; the shards are zeroed next, after any copy
        of them in flight (ordered on the device, no host wait)."""
        self.armed = False
        self._fresh.clear()
        self._taken.clear()
        if self.cuda and self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._events.clear()

    def nbytes(self) -> int:
        """Host bytes of the buffers."""
        return self._buffers.nbytes()

    def _landing(self, index: int, shard: torch.Tensor) -> torch.Tensor:
        """Where unit `index`'s copy of `shard` lands: the last bytes of its buffer, in the shard's dtype."""
        if shard.dtype != self.home.dtype:
            raise AssertionError(f"gradient staging: unit {index}'s shard is {shard.dtype}, but the placement stages "
                                 f"{self.home.dtype} copies (placement.py: grad_staging is the gradient shards' dtype)")
        landing = landing_view(self._buffers.get(index, shard.numel()), shard.dtype)
        self.copied_bytes += landing.numel() * landing.element_size()  # what the copy into it carries
        return landing

    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream


class HostBuffers:
    """One host buffer per unit at `home` (pinned where it says), made on first use and kept: the gradient copies
    here and the step plan's updated parameters (step_plan.py) both stage through them."""

    def __init__(self, home: Home) -> None:
        self.home = home
        self._buffers: dict[int, torch.Tensor] = {}

    def get(self, index: int, numel: int) -> torch.Tensor:
        """Unit `index`'s buffer of `numel` elements (contents undefined until written)."""
        buf = self._buffers.get(index)
        if buf is None or buf.numel() != numel:
            home = self.home
            buf = self._buffers[index] = torch.empty(numel, dtype=home.dtype, device=home.device,
                                                     pin_memory=home.pinned)
        return buf

    def held(self, index: int) -> torch.Tensor:
        """Unit `index`'s buffer as it is (made by an earlier `get`)."""
        return self._buffers[index]

    def nbytes(self) -> int:
        """Host bytes of the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


# [Note: 16-bit copies, widened on the host] a tail this short is widened through a copy of itself (at most 128 KiB)
WIDEN_TAIL_NUMEL = 1 << 16


def landing_view(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The last `buf.numel() * dtype.itemsize` bytes of the flat `buf` as `buf.numel()` elements of `dtype`, no
    wider than `buf`'s: where a copy lands to be widened into `buf` in place (`buf` itself when the dtypes match)."""
    if dtype == buf.dtype:
        return buf
    wide, narrow = buf.element_size(), dtype.itemsize
    if narrow > wide:
        raise AssertionError(f"a {dtype} copy cannot be widened into a {buf.dtype} buffer")
    return buf.view(torch.uint8)[buf.numel() * (wide - narrow):].view(dtype)


def widen_in_place(buf: torch.Tensor, landing: torch.Tensor) -> None:
    """Cast `landing` (`landing_view(buf, ...)`) into `buf`, element i to element i, in place and exactly.

    Element k of `buf` ends at byte w*(k+1) and element k of the landing starts at byte n*(w-s) + s*k (w, s: the
    element sizes, n: the count). Widening k..k+c-1 writes bytes below w*(k+c) and reads from n*(w-s) + s*k on, so
    a block of c <= (n-k)*(w-s)/w elements from the front overwrites only landing elements already widened: half
    of what is left, for a 16 -> 32-bit cast. The last few are widened from a copy of themselves.
    """
    if landing is buf:
        return
    n, wide, narrow = buf.numel(), buf.element_size(), landing.element_size()
    k = 0
    while n - k > WIDEN_TAIL_NUMEL:
        c = (n - k) * (wide - narrow) // wide
        buf[k:k + c].copy_(landing[k:k + c])
        k += c
    buf[k:].copy_(landing[k:].clone())


class HostCopyDestination:
    """Unit `index`'s `GradDestination` (grads/grad_destination.py): its GradShard calls it around each delivery."""

    def __init__(self, staging: GradStaging, index: int) -> None:
        self.staging = staging
        self.index = index

    def before_write(self, shard: torch.Tensor) -> None:
        self.staging.before_write(self.index)

    def after_write(self, shard: torch.Tensor) -> None:
        self.staging.after_write(self.index, shard)
