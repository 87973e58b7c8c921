"""Pure arithmetic of flat layouts and shards; no tensors are touched and no process group is needed.

A *flat layout* places the elements of several parameters one after another in a single buffer, in a
fixed order, and pads the end so that the total is a multiple of the shard count N:

    padded_numel = ceil(sum(numels) / N) * N,    shard_numel = padded_numel / N,
    rank r owns elements [r * shard_numel, (r + 1) * shard_numel).

Even shards are what gloo and NCCL collectives require (gloo refuses uneven all-gathers outright).
Padding elements are always zero in parameters and gradients, so they never change a sum or a norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from math import prod
from typing import ClassVar, Sequence


@dataclass(frozen=True)
class Segment:
    """The part of one parameter that falls inside one rank's shard.

    param_index: position of the parameter in the layout; param_start/param_end: element range inside
    the flattened parameter; shard_start: where that range starts inside the shard.
    """

    param_index: int
    param_start: int
    param_end: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class FlatLayout:
    """Offsets of parameters in a flat buffer padded to a multiple of `num_shards`."""

    shapes: tuple[tuple[int, ...], ...]
    num_shards: int
    # every parameter lies inside one shard (flat/whole_tensor_layout.py); here shards cut anywhere
    whole_tensors: ClassVar[bool] = False
    # every shard has shard_numel elements; False: shards of unequal sizes, gathered and reduced per
    # owner (flat/whole_tensor_layout.py's UnpaddedWholeTensorLayout, stage 3)
    even_shards: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], num_shards: int) -> "FlatLayout":
        """Build a layout from parameter shapes (e.g. `[p.shape for p in params]`)."""
        return cls(tuple(tuple(int(d) for d in s) for s in shapes), int(num_shards))

    @cached_property
    def numels(self) -> tuple[int, ...]:
        return tuple(prod(s) for s in self.shapes)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return tuple(out)

    @cached_property
    def numel(self) -> int:
        """Elements of real parameter data (no padding)."""
        return sum(self.numels)

    @cached_property
    def padded_numel(self) -> int:
        n = self.num_shards
        return -(-self.numel // n) * n if self.numel else n

    @cached_property
    def shard_numel(self) -> int:
        return self.padded_numel // self.num_shards

    def shard_range(self, shard: int) -> tuple[int, int]:
        """The [start, end) element range of the flat buffer owned by `shard`."""
        if not 0 <= shard < self.num_shards:
            raise IndexError(f"shard {shard} out of range for {self.num_shards} shards")
        return shard * self.shard_numel, (shard + 1) * self.shard_numel

    def shard_size(self, shard: int) -> int:
        """Elements of `shard` (shard_numel for every shard of an even layout)."""
        lo, hi = self.shard_range(shard)
        return hi - lo

    def shard_ranges(self) -> list[tuple[int, int]]:
        """Every shard's [start, end) range, in rank order."""
        return [self.shard_range(r) for r in range(self.num_shards)]

    def segments(self, shard: int) -> list[Segment]:
        """Pieces of parameters inside `shard`'s range, in layout order (padding excluded)."""
        lo, hi = self.shard_range(shard)
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            start, end = max(off, lo), min(off + n, hi)
            if start < end:
                out.append(Segment(i, start - off, end - off, start - lo))
        return out

    def padding_ranges(self) -> list[tuple[int, int]]:
        """[start, end) ranges of the buffer that hold no parameter (always zero)."""
        return [(self.numel, self.padded_numel)] if self.padded_numel > self.numel else []

    def owners(self, param_index: int) -> list[int]:
        """Shards that hold at least one element of parameter `param_index`."""
        off, n = self.offsets[param_index], self.numels[param_index]
        if n == 0:
            return []
        return list(range(off // self.shard_numel, (off + n - 1) // self.shard_numel + 1))
