"""A gradient reduction in two dtypes over one flat buffer: `SplitReduce` (torch_autocast at stage 3).

Under torch_autocast (zerodp/precision/autocast.py) the lower-precision-safe modules' gradients are summed over
ranks in the autocast dtype and every other gradient in fp32. Stage 0-2 buckets never mix the two
(stage12/buckets.py splits them); a stage-3 unit is a module and may hold both (a transformer block's
Linear weights and its LayerNorm gains). Its reduction then runs as two collectives over the same
layout, so that every element is summed in its own dtype with the arithmetic of a one-dtype reduction:

    low   = the low ranges of the full buffer, cast to the low dtype, zeros elsewhere
    high  = the full buffer with its low ranges zeroed (in place)
    reduce each (same divisors, each in its own dtype); this rank's slice = high's, with the low
    ranges taken from low's (cast back)

A zero adds nothing to a sum, so each element's result is exactly what a reduction of its own dtype
gives. The cost is bytes: the unit crosses the wire once in each dtype (fp32 + bf16 = 1.5x one fp32
reduction) where DeepSpeed, whose stage 3 reduces per parameter, sends each element once.
"""

from __future__ import annotations

import torch

from ..flat.layout import FlatLayout


class SplitReduce:
    """Which ranges of a flat layout are reduced in `low_dtype` (the rest in the buffer's own dtype)."""

    def __init__(self, layout: FlatLayout, low: list[bool], low_dtype: torch.dtype) -> None:
        self.low_dtype = low_dtype
        self.low_ranges = [(offset, offset + numel)
                           for offset, numel, is_low in zip(layout.offsets, layout.numels, low) if is_low]

    def split(self, full: torch.Tensor) -> torch.Tensor:
        """The low-dtype send buffer (the low ranges of `full`, cast; zeros elsewhere); those ranges of
        `full` are zeroed in place, so that `full` is the high-dtype send buffer."""
        low = torch.zeros(full.numel(), dtype=self.low_dtype, device=full.device)
        for start, end in self.low_ranges:
            low[start:end].copy_(full[start:end])  # the cast: each rank's gradient rounded once, as DeepSpeed
            full[start:end].zero_()
        return low

    def merge(self, high: torch.Tensor, low: torch.Tensor, shard_range: tuple[int, int]) -> torch.Tensor:
        """This rank's reduced slice: `high` (in place) with the low ranges inside `shard_range` taken from
        `low`, both slices of `shard_range`."""
        first, last = shard_range
        for start, end in self.low_ranges:
            a, b = max(start, first), min(end, last)
            if a < b:
                high[a - first:b - first].copy_(low[a - first:b - first])
        return high
