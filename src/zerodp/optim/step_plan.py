"""How one optimizer step walks this rank's chunks: `StepPlan`, the only place that knows what is offloaded.

The sharded optimizer (optimizer.py) computes the gradient norm, then hands the plan its gradients and a
function that steps a window of chunks. The plan, built once from the `placement.Placement` and the
units, decides:

  windows    all chunks at once (nothing offloaded); one unit at a time (stage 3's offload_param, the
             masters being views of shards that are in memory only while held); or the offloaded
             optimizer state's windows (offload/optimizer_state.py: [Note: offload pipeline]);
  residency  what each window holds in memory: the parameter shards its chunks are views of, the
             gradient shards that rest in files (fp32 offload_param nvme), each only for its window;
  gradients  which tensor each chunk's `.grad` is: a view of the unit's gradient shard, clipped in place
             (streamed shards: clipped per window, each chunk once), or, when the step runs on the host
             while the model computes on a GPU (ZeRO-Offload), a view of a pinned host copy of it, queued
             as the shard was reduced for the last time before the step (optim/grad_staging.py);
  write-back how the updated masters reach the parameter shards: not at all (they are the shards), a
             copy, or (host step) a cast into a pinned host buffer and a copy to the GPU.

The windows and arithmetic on the CPU are exactly those of the code this replaces, so results are
bitwise unchanged there. [Note: host-step arithmetic] On a GPU the host step's gradients are bitwise those
a step on the GPU would read: the copy is of the shard as reduced, in its own dtype, widened to fp32 on the
host (a bf16/fp16 -> fp32 cast is exact: optim/grad_staging.py [Note: 16-bit copies, widened on the host]); the
loss-scale division and the clip multiplication run on the host copy, and both are single correctly
rounded IEEE operations per element (the clip coefficient is the same float64 value, cast to the
gradient's dtype the same way on either device), so the host computes what the GPU computes. The
global norm, a reduction whose summation order is the device's, is taken on the GPU from the shards
before the step (the same value a GPU step takes); only its coefficient reaches the host. What is not
bitwise between host and GPU is the optimizer's own arithmetic (tests/gpu/test_cuda_offload.py).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Optional

import torch

from .grad_staging import GradStaging, HostBuffers
from ..offload.placement import HOST, Placement
from ..shard.seams import ShardedUnit


def check_host_step(group_settings: list[dict], placement: Placement) -> None:
    """A step on the host (ZeRO-Offload on a GPU) cannot run an optimizer built for CUDA graphs: say so now,
    not as torch's assertion inside the first step."""
    if placement.steps_on_host and any(settings.get("capturable") for settings in group_settings):
        raise ValueError("offload_optimizer steps the optimizer on the host (the CPU), but it was built with "
                         "capturable=True, which needs its tensors on the GPU; drop capturable=True or remove "
                         "zero_optimization.offload_optimizer")


class StepPlan:
    """The windows, residency, gradient binding and write-back of one step; see the module docstring."""

    def __init__(self, units: list[ShardedUnit], chunks: list[list[torch.Tensor]], masters: list[torch.Tensor],
                 placement: Placement, chunk_numel: int, offload=None, staging: Optional[GradStaging] = None) -> None:
        self.units = units
        self.chunks = chunks
        self.masters = masters
        self.placement = placement
        self.chunk_numel = chunk_numel
        self.offload = offload  # offload.OffloadedOptimizerState: its windows, or None
        self.whole = [unit.layout.whole_tensors for unit in units]
        self.param_offsets = [0]  # where each unit's parameters start in the flags of `received`
        for unit in units:
            self.param_offsets.append(self.param_offsets[-1] + len(unit.layout.shapes))
        self.unit_of_chunk = {id(c): i for i, per_unit in enumerate(chunks) for c in per_unit}
        # Decided once: a master that *is* an offloaded shard is written only while its shard is held;
        # a gradient shard resting in files is read per window.
        self.hold_params = [placement.masters_are_shards and unit.param_offloaded for unit in units]
        self.stream_grads = [unit.grad_offloaded for unit in units]
        self.per_unit = any(unit.param_offloaded for unit in units)  # offload_param without optimizer offload
        # the step reads its gradients from (and writes parameters through) host buffers where the placement
        # gives them one: ZeRO-Offload on a GPU (a CPU test forces it to run this path: test_placement.py)
        self.host_step = placement.grad_staging is not None
        # host step: `staging`, the gradient shards' destination composed by the engine (engine/grad_path.py),
        # holds each shard's copy queued at its last delivery before the step (streamed shards: read per window
        # at the step, and copied then). Without one (this class used alone) every copy is made at the step.
        if self.host_step and staging is None:
            staging = GradStaging(placement.grad_staging, placement.compute.device, placement.masters.dtype)
        self.staging = staging if self.host_step else None
        self._param_staging = HostBuffers(placement.param_staging) if self.host_step else None
        self._param_copies: dict[int, "torch.cuda.Event"] = {}  # unit -> the copy out of its staging buffer in flight
        self._coef: Optional[torch.Tensor] = None  # this step's clip coefficient (None: no clipping)

    # -- gradients -----------------------------------------------------------------------------

    def bind_all(self, grads: list[torch.Tensor], coef: Optional[torch.Tensor], received: Optional[torch.Tensor],
                 scale: float = 1.0) -> None:
        """Clip by `coef` (a tensor on the gradients' device; None: no clipping) and bind the gradients that are
        in memory (streamed ones are bound per window, `run`). `grads` are the units' gradients converted to
        the masters' dtype and divided by `scale`; a host step reads its units' host copies of the shards as
        reduced instead and divides and clips them there ([Note: host-step arithmetic])."""
        self._coef = coef
        if self.host_step:
            self._bind_host(coef, received, scale)
            return
        for index, g in enumerate(grads):
            if not self.stream_grads[index]:
                if coef is not None:
                    g.mul_(coef)
                self.bind(index, g, received)

    def _bind_host(self, coef: Optional[torch.Tensor], received: Optional[torch.Tensor], scale: float) -> None:
        staged = {index: self.staging.take(index, unit.grad_shard) for index, unit in enumerate(self.units)
                  if not self.stream_grads[index]}
        self.staging.wait()  # note: a sync point (inside): the host reads the copies next
        host_coef = coef.to(HOST) if coef is not None else None  # computed on the device; free after the sync
        for index, buf in staged.items():
            if scale != 1.0:
                buf.div_(scale)
            if host_coef is not None:
                buf.mul_(host_coef)
            self.bind(index, buf, received)

    def drop_grads(self) -> None:
        """After the step, taken or not: no chunk keeps a gradient, the host copies are forgotten."""
        for chunks in self.chunks:
            for chunk in chunks:
                chunk.grad = None
        if self.staging is not None:
            self.staging.settle()

    def bind(self, index: int, g: torch.Tensor, received: Optional[torch.Tensor],
              window: Optional[set[int]] = None) -> None:
        """Give unit `index`'s chunks their gradients: views of `g` (a streamed shard's chunks in `window`,
        ids of the chunks this part of the step updates, are clipped here)."""
        chunks = self.chunks[index]
        if self.stream_grads[index]:  # g is the shard itself, resident (not dirty) for this part of the step
            # Clipped in place, each chunk once, in the one window that steps it: a unit's shard may span
            # windows and be evicted and read again between them, and nothing reads it after the step, whose
            # zero_grad drops it without a write (ShardStore.zero). Scaled copies cost 2.5 s of a
            # 500m-proxy step's 5.0 s (bench/results/big_offload_step.md).
            parts = list(g.split(self.chunk_numel))
            for chunk, g_chunk in zip(chunks, parts):
                if self._coef is not None and window is not None and id(chunk) in window:
                    g_chunk.mul_(self._coef)
            if self.host_step:  # clipped on the device as a device step would be, then copied
                host = self.staging.copy_now(index, g)
                self.staging.wait()
                parts = list(host.split(self.chunk_numel))
            for chunk, g_chunk in zip(chunks, parts):
                chunk.grad = g_chunk
            return
        if not self.whole[index]:
            for chunk, g_chunk in zip(chunks, g.split(self.chunk_numel)):
                chunk.grad = g_chunk
            return
        # shaped like the parameter; None where no rank produced a gradient (torch skips it)
        unit, offset = self.units[index], self.param_offsets[index]
        for seg, chunk in zip(unit.layout.segments(unit.shard_index), chunks):
            got = received is None or bool(received[offset + seg.param_index])
            chunk.grad = g[seg.shard_start:seg.shard_start + seg.numel].view(chunk.shape) if got else None

    # -- the windows ---------------------------------------------------------------------------

    def run(self, step_window: Callable[[Optional[list]], None], received: Optional[torch.Tensor]) -> None:
        """Call `step_window(window)` over every chunk once (window None: all chunks), each window with
        what it reads held in memory."""
        if self.offload is not None:  # the state streams through the step, one window of chunks at a time
            self.offload.step(lambda window: self._held(window, step_window, received))
        elif self.per_unit:  # offload_param: one unit's shard in memory at a time
            for chunks in self.chunks:
                self._held(chunks, step_window, received)
        else:
            step_window(None)

    def _held(self, window: list, step_window, received: Optional[torch.Tensor]) -> None:
        indices = sorted({self.unit_of_chunk[id(c)] for c in window})
        params = [i for i in indices if self.hold_params[i]]
        grads = [i for i in indices if self.stream_grads[i]]
        if not params and not grads:
            step_window(window)
            return
        with holding([self.units[i].resident(dirty=True) for i in params]), \
                holding([self.units[i].grad_resident() for i in grads]):
            stepped = {id(c) for c in window}
            for i in grads:
                self.bind(i, self.units[i].grad_shard, received, stepped)
            step_window(window)
            for i in grads:  # the shards may be evicted after this block: no view of them may remain
                for chunk in self.chunks[i]:
                    chunk.grad = None

    def state_resident(self, chunks: list, read: bool = True, write: bool = True):
        """Hold `chunks`' optimizer state in the inner optimizer for a block (checkpoints): a no-op unless the
        state rests in an offload store (offload/optimizer_state.py `resident`)."""
        if self.offload is None:
            return contextlib.nullcontext()
        return self.offload.resident(self.offload.chunk_indices(chunks), read=read, write=write)

    # -- after the step --------------------------------------------------------------------------

    def write_back(self) -> None:
        """Make the parameter shards hold the updated masters (cast to the parameters' dtype)."""
        if self.placement.masters_are_shards:
            return  # updated in place
        for index, (unit, master) in enumerate(zip(self.units, self.masters)):
            with unit.resident(dirty=True):
                if self.host_step:
                    self._copy_to_device(index, unit.param_shard, self._param_staged(index, master))
                else:
                    unit.param_shard.copy_(master)

    def _copy_to_device(self, index: int, shard: torch.Tensor, staged: torch.Tensor) -> None:
        """Copy a unit's staged parameters into its shard. From a pinned buffer into GPU memory the copy is queued
        on the compute stream without a host wait (the next forward's kernels run after it, in stream order),
        and an event marks when the buffer may be written again (`_param_staged`); elsewhere it is a plain copy."""
        if not (shard.is_cuda and staged.is_pinned()):
            shard.copy_(staged)
            return
        shard.copy_(staged, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(shard.device))
        self._param_copies[index] = event

    def _param_staged(self, index: int, master: torch.Tensor) -> torch.Tensor:
        """The master cast to the parameters' dtype on the host, in a pinned buffer: the copy to the GPU is
        then one DMA of 2-byte elements, and the cast is the same round-to-nearest-even a GPU does."""
        in_flight = self._param_copies.pop(index, None)
        if in_flight is not None:
            # note: a sync point, normally free: the last step's copy out of this buffer finished long ago (a
            # whole forward and backward ran after it on the same stream); without it the host could overwrite
            # the buffer while the DMA still reads it
            in_flight.synchronize()
        return self._param_staging.get(index, master.numel()).copy_(master)

    def staging_bytes(self) -> int:
        """Host bytes of the pinned staging buffers (host step)."""
        if not self.host_step:
            return 0
        return self.staging.nbytes() + self._param_staging.nbytes()


@contextlib.contextmanager
def holding(blocks: Iterable):
    """Enter `blocks` in order for one block and leave them in that same order (not nested, not reversed):
    an offload store then sees exactly the acquires and releases of one batched `resident([...])`, so
    which shards it evicts, writes and reads ahead is what it was when callers passed it the shards."""
    entered = []
    try:
        for block in blocks:
            block.__enter__()
            entered.append(block)
        yield
    finally:
        for block in entered:
            block.__exit__(None, None, None)
