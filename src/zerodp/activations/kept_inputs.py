"""The inputs of one checkpointed region, as kept between its forward and its recomputation.

Plain activation checkpointing keeps each input whole where it was computed. ZeRO-R changes where
and how much (the `activation_checkpointing` section):

    partition_activations   this rank's 1/TP piece (partition.py), all-gathered before recomputing
    cpu_checkpointing       in host memory (host_offload.py), copied back before recomputing
    contiguous_memory_...   copied into a slot of a buffer allocated once (contiguous.py)

Only floating-point tensors are kept this way (DeepSpeed's rule: token ids, masks and other
integer tensors are small and kept as they are; so are non-tensor arguments). `KeptBytes` counts
the bytes every live `KeptInputs` holds, by place, and their peak: what a test or a report reads to
see checkpoint memory fall by TP (Pa) or move to the host (cpu).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from .contiguous import ContiguousBuffers, Slot
from .host_offload import HostCopy, HostOffload, host_placement
from .model_parallel import ModelParallelGroup
from .partition import gather_whole, keep_piece, piece_numel

DEVICE, HOST = "device", "host"


@dataclass
class KeptBytes:
    """Bytes held by live kept inputs, by place ("device": where they were computed; "host"), and the peak."""

    live: dict[str, int] = field(default_factory=lambda: {DEVICE: 0, HOST: 0})
    peak: dict[str, int] = field(default_factory=lambda: {DEVICE: 0, HOST: 0})

    def add(self, place: str, nbytes: int) -> None:
        self.live[place] += nbytes
        self.peak[place] = max(self.peak[place], self.live[place])

    def remove(self, place: str, nbytes: int) -> None:
        self.live[place] -= nbytes

    def reset_peak(self) -> None:
        self.peak = dict(self.live)


@dataclass(frozen=True)
class KeepPolicy:
    """How a region keeps its floating inputs (from the `activation_checkpointing` settings)."""

    partition: bool
    cpu: bool
    contiguous: bool
    group: ModelParallelGroup


@dataclass(eq=False)
class _Kept:
    """One floating input: its bytes (whole or a piece; a device tensor or a host copy) and how to restore it."""

    data: Any  # torch.Tensor on the device, or HostCopy
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    piece: bool


class KeptInputs:
    """A region's arguments with its floating tensors kept as the policy says; `restore()` rebuilds them."""

    def __init__(self, args: Sequence[Any], policy: KeepPolicy, offload: HostOffload,
                 buffers: Optional[ContiguousBuffers], ledger: KeptBytes):
        self._items: list[Any] = []
        self._policy = policy
        charges: list[tuple[str, int]] = []
        slots: list[Slot] = []
        position = 0
        for arg in args:
            if not (isinstance(arg, torch.Tensor) and arg.is_floating_point()):
                self._items.append(arg)  # kept as it is
                continue
            kept, place, nbytes, slot = self._keep(arg, position, policy, offload, buffers)
            position += 1
            self._items.append(kept)
            charges.append((place, nbytes))
            if slot is not None:
                slots.append(slot)
        for place, nbytes in charges:
            ledger.add(place, nbytes)
        # The bytes are counted, and the slots held, for as long as this object lives: until the region's
        # backward drops it, or the graph holding it is freed unused.
        weakref.finalize(self, _release, ledger, charges, slots)

    @staticmethod
    def _keep(tensor: torch.Tensor, position: int, policy: KeepPolicy, offload: HostOffload,
              buffers: Optional[ContiguousBuffers]) -> tuple[_Kept, str, int, Optional[Slot]]:
        group = policy.group
        numel = piece_numel(tensor.numel(), group.world_size) if policy.partition else tensor.numel()
        place = HOST if policy.cpu else DEVICE
        slot = None
        out = None
        if buffers is not None:
            target = torch.device("cpu") if policy.cpu else tensor.device
            slot = buffers.acquire(position, numel, tensor.dtype, target, host_placement(tensor.device).pinned
                                   and policy.cpu)
            out = slot.view
        if policy.partition:
            # The piece is taken on the device, then offloaded: one device-to-host copy of 1/TP of the input.
            data = keep_piece(tensor, group, None if policy.cpu else out)
        elif policy.cpu or out is not None:
            data = tensor.detach().reshape(-1)
        else:
            data = tensor.detach()  # plain checkpointing: a reference to the input itself
        if policy.cpu:
            data = offload.put(data, out)
        elif out is not None and data.data_ptr() != out.data_ptr():
            out.copy_(data)
            data = out
        stored = data.host if isinstance(data, HostCopy) else data
        nbytes = stored.numel() * stored.element_size()
        return _Kept(data, tensor.shape, tensor.device, tensor.requires_grad, policy.partition), place, nbytes, slot

    def restore(self) -> tuple[Any, ...]:
        """The arguments again, floating tensors whole on their device as detached leaves with their
        `requires_grad` (partitioned ones all-gathered: a collective on the model-parallel group)."""
        out = []
        for item in self._items:
            if not isinstance(item, _Kept):
                out.append(item)
                continue
            data = HostOffload.take(item.data, item.device) if isinstance(item.data, HostCopy) else item.data
            if item.piece:
                whole = gather_whole(data, item.shape, self._policy.group, item.device)
            else:
                whole = data[: item.shape.numel()].view(item.shape) if data.shape != item.shape else data
            whole = whole.detach()
            whole.requires_grad_(item.requires_grad)
            out.append(whole)
        return tuple(out)


def _release(ledger: KeptBytes, charges: list[tuple[str, int]], slots: list[Slot]) -> None:
    for place, nbytes in charges:
        ledger.remove(place, nbytes)
    for slot in slots:
        ContiguousBuffers.release(slot)
