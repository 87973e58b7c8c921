"""CB: kept checkpoint inputs copied into buffers allocated once, one slot per checkpointed region.

Checkpoints live from a region's forward to its recomputation in backward, while the activations
computed between them live a few microseconds: allocated from one pool they interleave, and the
free space between long-lived checkpoints fragments. The ZeRO paper's constant-size buffers avoid
this: one buffer per input position (the first, second, ... tensor argument of a region) holds
`number_checkpoints` slots, handed out in order and given back when the region's kept inputs die
(their backward is done, or the graph was dropped).

Departures from DeepSpeed (docs/activations.md):
  - DeepSpeed asserts when `number_checkpoints` is missing. Here the first forward counts its
    regions (inputs kept in ordinary tensors meanwhile) and the buffer is allocated for that count
    when they have all been released; a later forward with more regions grows it the same way.
    Set explicitly, a forward with more regions than slots is an error naming the key.
  - DeepSpeed accepts contiguous buffers only with partition_activations; here they hold whatever
    is kept: whole inputs, pieces, on the device or in (pinned) host memory.
  - an input larger than its position's slot (slots are sized by the first input seen there) is
    an error: such regions are not homogeneous; call reset() to size the buffers again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(eq=False)
class _Arena:
    """The buffer of one input position (and dtype and place)."""

    slot_numel: int
    dtype: torch.dtype
    device: torch.device
    pinned: bool
    buffer: Optional[torch.Tensor] = None
    free: list[int] = field(default_factory=list)
    capacity: int = 0
    live: int = 0
    peak_live: int = 0

    def allocate(self, capacity: int) -> None:
        self.buffer = torch.empty(capacity * self.slot_numel, dtype=self.dtype, device=self.device,
                                  pin_memory=self.pinned)
        self.capacity, self.free = capacity, list(range(capacity))


@dataclass(frozen=True, eq=False)
class Slot:
    """A kept input's place: `view` in a buffer, or None while the buffer is still being sized."""

    arena: _Arena
    index: Optional[int]
    view: Optional[torch.Tensor]


class ContiguousBuffers:
    """The buffers of every input position; `acquire` a slot per kept input, `release` it when the input dies."""

    def __init__(self, number_checkpoints: Optional[int]):
        self.number_checkpoints = number_checkpoints
        self._arenas: dict[tuple, _Arena] = {}

    @property
    def buffer_bytes(self) -> int:
        """Bytes allocated for buffers (whether or not their slots are in use)."""
        return sum(a.buffer.numel() * a.buffer.element_size() for a in self._arenas.values() if a.buffer is not None)

    def acquire(self, position: int, numel: int, dtype: torch.dtype, device: torch.device, pinned: bool) -> Slot:
        """A slot for a `numel`-element input at `position`."""
        key = (position, dtype, device)
        arena = self._arenas.get(key)
        if arena is None:
            arena = self._arenas[key] = _Arena(numel, dtype, device, pinned)
        if numel > arena.slot_numel:
            raise ValueError(f"contiguous_memory_optimization: checkpointed input {position} has {numel} elements, "
                             f"but its buffer's slots hold {arena.slot_numel} (sized by the first region); the "
                             f"regions are not homogeneous: call deepspeed.checkpointing.reset() to size the "
                             f"buffers again, or switch contiguous_memory_optimization off")
        if arena.buffer is None and arena.live == 0:
            capacity = self.number_checkpoints or arena.peak_live  # learned from an earlier forward, if any
            if capacity:
                arena.allocate(capacity)
        arena.live += 1
        arena.peak_live = max(arena.peak_live, arena.live)
        if arena.buffer is not None and arena.free:
            index = arena.free.pop(0)
            start = index * arena.slot_numel
            return Slot(arena, index, arena.buffer.narrow(0, start, numel))
        if self.number_checkpoints is not None:
            arena.live -= 1
            raise RuntimeError(f"contiguous_memory_optimization: more than number_checkpoints="
                               f"{self.number_checkpoints} checkpointed regions are alive at once; raise "
                               f"number_checkpoints to the number of regions per forward (or leave it unset to "
                               f"learn it), or call deepspeed.checkpointing.reset() after forwards without backward")
        return Slot(arena, None, None)  # sizing: kept in an ordinary tensor this time

    @staticmethod
    def release(slot: Slot) -> None:
        """Give the slot back (called when the kept input dies)."""
        arena = slot.arena
        arena.live -= 1
        if slot.index is not None:
            arena.free.append(slot.index)
        if arena.live == 0:
            arena.free = list(range(arena.capacity))  # hand slots out in order again
            if arena.peak_live > arena.capacity and arena.buffer is not None:
                arena.buffer, arena.capacity, arena.free = None, 0, []  # grow at the next forward

    def reset(self) -> None:
        """Drop every buffer (slots still held keep their memory until their inputs die)."""
        self._arenas = {}
