"""A flat layout whose shard boundaries fall on tensor boundaries: each rank owns whole tensors.

Optimizers that read a whole matrix (torch.optim.Muon orthogonalises each 2-D update, Adafactor
keeps row and column second moments and clips by the update's RMS) cannot step a slice cut at an
arbitrary element. `WholeTensorLayout` keeps everything else about a `FlatLayout` (one padded flat
buffer, N equal shards, so reduce-scatter and all-gather, checkpoints and resharding work through
`segments()` unchanged) and only moves the parameters: each one is assigned to one shard, and the
shard's parameters are packed from the shard's start, in layout order, followed by padding.

Balance (greedy, largest first, onto the least-loaded shard; ties to the lower shard):
    load_r = sum of numels owned by r,   shard_numel = max_r load_r,
    padding = N * shard_numel - sum(numels)
The padding is the price of whole tensors: it travels in every collective, so the bytes moved are
padded_numel / numel times the elementwise path's (measured in tests/dist/test_whole_tensor.py and
reported by memory_report). Greedy largest-first keeps max load <= 4/3 of the optimum (Graham).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from .layout import FlatLayout


@dataclass(frozen=True)
class WholeTensorLayout(FlatLayout):
    """A `FlatLayout` in which every parameter lies inside exactly one shard."""

    whole_tensors: ClassVar[bool] = True

    @cached_property
    def shard_of(self) -> tuple[int, ...]:
        """The shard that owns each parameter."""
        loads = [0] * self.num_shards
        owner = [0] * len(self.numels)
        for i in sorted(range(len(self.numels)), key=lambda i: (-self.numels[i], i)):
            r = min(range(self.num_shards), key=lambda r: (loads[r], r))
            owner[i] = r
            loads[r] += self.numels[i]
        return tuple(owner)

    @cached_property
    def shard_loads(self) -> tuple[int, ...]:
        """Elements of real parameter data in each shard."""
        loads = [0] * self.num_shards
        for r, n in zip(self.shard_of, self.numels):
            loads[r] += n
        return tuple(loads)

    @cached_property
    def shard_numel(self) -> int:
        return max(max(self.shard_loads), 1)

    @cached_property
    def padded_numel(self) -> int:
        return self.shard_numel * self.num_shards

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        fill = [r * self.shard_numel for r in range(self.num_shards)]
        out = []
        for r, n in zip(self.shard_of, self.numels):
            out.append(fill[r])
            fill[r] += n
        return tuple(out)

    def padding_ranges(self) -> list[tuple[int, int]]:
        return [(r * self.shard_numel + load, (r + 1) * self.shard_numel)
                for r, load in enumerate(self.shard_loads) if load < self.shard_numel]


def layout_of(shapes, num_shards: int, whole_tensors: bool) -> FlatLayout:
    """The layout a unit of parameters gets: whole-tensor shards where its optimizer needs them."""
    return (WholeTensorLayout if whole_tensors else FlatLayout).of(shapes, num_shards)
