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

`UnpaddedWholeTensorLayout` (stage 3) drops the padding: shard r holds exactly rank r's tensors,
the shards one after another in rank order, so shards have unequal sizes and

    padded_numel = numel,   shard_range(r) = [sum of loads below r, + load_r)

Stage 3 cuts the model into one unit per block, and a block has few matrices (4 in a GPT block):
over 8 ranks, equal shards padded each unit to 8 x the largest matrix, 2.7 x its real size (166%
padding on the test GPT), and that padding was gathered twice and reduced once per step. Unequal
shards move exactly the unit's elements (comm.all_gather_uneven, comm.reduce_scatter_uneven: one
broadcast from / reduce to each owner on NCCL, a pairwise exchange of the ranges on gloo), the bytes
of an all-gather / reduce-scatter of the unpadded buffer. Balance then spans units: each unit is
assigned on top of the loads of the units before it (`base_loads`), so a rank that took the large
matrix of one block takes the small ones of the next, and the fullest rank's total stays near
Psi/N even where one unit alone has fewer tensors than ranks.
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
        loads = self._initial_loads()
        owner = [0] * len(self.numels)
        for i in sorted(range(len(self.numels)), key=lambda i: (-self.numels[i], i)):
            r = min(range(self.num_shards), key=lambda r: (loads[r], r))
            owner[i] = r
            loads[r] += self.numels[i]
        return tuple(owner)

    def _initial_loads(self) -> list[int]:
        """Loads the greedy assignment starts from (earlier units' in UnpaddedWholeTensorLayout)."""
        return [0] * self.num_shards

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


@dataclass(frozen=True)
class UnpaddedWholeTensorLayout(WholeTensorLayout):
    """Whole tensors per rank, shards of unequal sizes and no padding (see the module docstring)."""

    base_loads: tuple[int, ...] = ()  # elements each rank already owns in earlier units
    even_shards: ClassVar[bool] = False

    @classmethod
    def after(cls, shapes, num_shards: int, base_loads=()) -> "UnpaddedWholeTensorLayout":
        """The layout of `shapes`, balanced on top of `base_loads` (a previous layout's `loads_after`)."""
        base = tuple(int(x) for x in base_loads) or (0,) * int(num_shards)
        if len(base) != num_shards:
            raise ValueError(f"base_loads has {len(base)} entries for {num_shards} shards")
        return cls(tuple(tuple(int(d) for d in s) for s in shapes), int(num_shards), base)

    def _initial_loads(self) -> list[int]:
        return list(self.base_loads) or [0] * self.num_shards

    @cached_property
    def loads_after(self) -> tuple[int, ...]:
        """Elements each rank owns in the earlier units and this one: the next unit's `base_loads`."""
        base = self.base_loads or (0,) * self.num_shards
        return tuple(b + n for b, n in zip(base, self.shard_loads))

    @cached_property
    def shard_starts(self) -> tuple[int, ...]:
        starts, acc = [], 0
        for load in self.shard_loads:
            starts.append(acc)
            acc += load
        return tuple(starts)

    @cached_property
    def shard_numel(self) -> int:
        """The largest shard (shards differ: use `shard_size(r)` for one rank's)."""
        return max(self.shard_loads)

    @cached_property
    def padded_numel(self) -> int:
        return self.numel

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        fill = list(self.shard_starts)
        out = []
        for r, n in zip(self.shard_of, self.numels):
            out.append(fill[r])
            fill[r] += n
        return tuple(out)

    def shard_range(self, shard: int) -> tuple[int, int]:
        if not 0 <= shard < self.num_shards:
            raise IndexError(f"shard {shard} out of range for {self.num_shards} shards")
        return self.shard_starts[shard], self.shard_starts[shard] + self.shard_loads[shard]

    def padding_ranges(self) -> list[tuple[int, int]]:
        return []

    def owners(self, param_index: int) -> list[int]:
        return [self.shard_of[param_index]] if self.numels[param_index] else []


def layout_of(shapes, num_shards: int, whole_tensors: bool, base_loads=None) -> FlatLayout:
    """The layout a unit of parameters gets: whole-tensor shards where its optimizer needs them;
    unpadded, balanced on top of `base_loads`, where those are given (stage 3)."""
    if whole_tensors and base_loads is not None:
        return UnpaddedWholeTensorLayout.after(shapes, num_shards, base_loads)
    return (WholeTensorLayout if whole_tensors else FlatLayout).of(shapes, num_shards)
