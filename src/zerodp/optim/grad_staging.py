"""Reduced gradient shards copied into pinned host buffers as they become final: `GradStaging` (ZeRO-Offload).

When the optimizer steps on the host while the model computes on a GPU (`placement.Placement.steps_on_host`),
the step reads each unit's gradient shard from a host buffer (`Placement.grad_staging`: page-locked, the
master dtype). Copied at the step, the copies of every unit queue behind the whole backward and the host
waits for all of them at once. Here each unit's copy is queued the moment its shard holds its final value
for the step, while the backward goes on computing the next units:

    stage 1   at the accumulation boundary's reduce-scatter of the bucket (its only reduction)
    stage 2   at the boundary micro-step's reduction of the bucket (the last one adding into the shard)
    stage 3   at the boundary micro-step's reduction of the unit

`arm(final)` runs before every backward (final: it is the boundary's). While armed, every delivery of a
reduced slice into a shard (grads/grad_shard.py [Note: reduced shard destination]) queues a copy of the
whole shard on a side stream, ordered after the delivery by the stream's wait on the current one; the copy
is then "fresh". A shard delivered again in the same backward (a late gradient's second round) is copied
again: `before_write` makes the current stream wait for the copy in flight first, so the add never races
the read. A shard not delivered during the boundary's backward (a stage-3 unit no rank touched at the last
micro-step) is not fresh: `take` copies it at the step (`copy_now`), the path every shard took before.

`wait()` is the step's sync point: the host reads the buffers only after it. On a CPU (the forced path of
the tests, tests/unit/test_placement.py) host and device are one memory: copies are plain and synchronous.

What is copied is the shard as reduced (the accumulation dtype, cast exactly to fp32); the loss-scale
division and the clip multiplication are the step's, applied to the host copy (optim/step_plan.py
`bind_all`): elementwise, correctly rounded IEEE operations, so the host computes bitwise what the GPU would.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..placement import Home


class GradStaging:
    """Pinned host copies of units' gradient shards, queued as each is delivered at the boundary (see above)."""

    def __init__(self, home: Home, device: torch.device) -> None:
        self.home = home                      # where the copies live (pinned host memory, master dtype)
        self.device = torch.device(device)    # where the shards live (the model's device)
        self.cuda = self.device.type == "cuda"
        self.armed = False                    # deliveries now are the step's final values
        self._buffers = HostBuffers(home)             # unit index -> its host buffer (allocated once)
        self._events: dict[int, object] = {}          # unit index -> the event of its copy in flight (CUDA)
        self._fresh: set[int] = set()                 # units whose buffer holds the shard's final value
        self._stream = None                           # the side stream of the copies (CUDA, made on first use)
        self.staged_copies = 0                        # copies queued at deliveries (tests read it)

    # -- during the backward ---------------------------------------------------------------------

    def arm(self, final: bool) -> None:
        """Before a backward: `final` when it is the accumulation boundary's (its deliveries are the step's)."""
        self.armed = final
        if final:
            self._fresh.clear()  # earlier copies (a previous backward at this boundary) may be stale now

    def observer(self, index: int) -> "DeliveryObserver":
        """What unit `index`'s gradient shard calls around each delivery (GradShard.observe_deliveries)."""
        return DeliveryObserver(self, index)

    def before_write(self, index: int) -> None:
        """A delivery is about to add into unit `index`'s shard: it must not overtake a copy of it in flight."""
        event = self._events.get(index)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def after_write(self, index: int, shard: torch.Tensor) -> None:
        """Unit `index`'s shard received a reduced slice; while armed, queue its copy to the host."""
        if not self.armed:
            return
        buf = self._buffers.get(index, shard.numel())
        if not self.cuda:  # one memory: a plain copy
            buf.copy_(shard)
        else:
            stream = self._side_stream()
            # the copy reads what the current stream has just written: order it after that, not after more
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                buf.copy_(shard, non_blocking=True)  # device -> pinned host: a DMA beside the backward's kernels
                event = self._events.get(index) or torch.cuda.Event()
                event.record(stream)
            self._events[index] = event
        self._fresh.add(index)
        self.staged_copies += 1

    # -- at the step -------------------------------------------------------------------------------

    def take(self, index: int, shard: torch.Tensor) -> torch.Tensor:
        """Unit `index`'s host copy of `shard`: the one queued at its last delivery, or (none fresh) one
        queued now. Read it only after `wait()`."""
        if index in self._fresh:
            return self._buffers.get(index, shard.numel())
        return self.copy_now(index, shard)

    def copy_now(self, index: int, g: torch.Tensor) -> torch.Tensor:
        """Queue a copy of `g` into unit `index`'s buffer on the current stream (read it after `wait()`)."""
        buf = self._buffers.get(index, g.numel())
        buf.copy_(g, non_blocking=self.home.pinned)
        self._fresh.discard(index)  # the buffer no longer holds the copy made at the delivery
        return buf

    def wait(self) -> None:
        # note: a sync point. The copies return before they are done; the host optimizer must not read the
        # buffers earlier. The side stream's copies were queued during the backward and are mostly done.
        if self.cuda:
            if self._stream is not None:
                self._stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()  # the copies queued at the step (copy_now)

    def settle(self) -> None:
        """After the step (taken or skipped): forget the copies; the shards are zeroed next, after any copy
        of them in flight (ordered on the device, no host wait)."""
        self.armed = False
        self._fresh.clear()
        if self.cuda and self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._events.clear()

    def nbytes(self) -> int:
        """Host bytes of the buffers."""
        return self._buffers.nbytes()

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

    def nbytes(self) -> int:
        """Host bytes of the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class DeliveryObserver:
    """Unit `index`'s link to its `GradStaging`, called by its GradShard around each delivery."""

    def __init__(self, staging: GradStaging, index: int) -> None:
        self.staging = staging
        self.index = index

    def before_write(self, shard: torch.Tensor) -> None:
        self.staging.before_write(self.index)

    def after_write(self, shard: torch.Tensor) -> None:
        self.staging.after_write(self.index, shard)
