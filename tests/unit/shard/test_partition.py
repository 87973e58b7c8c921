"""Flat layouts: even shards, padding at the end, and segments that tile every parameter exactly once."""

import pytest

from zerodp.comm import chunk_ranges
from zerodp.shard.flat.layout import FlatLayout


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7])
def test_segments_tile_every_parameter_once(shards):
    layout = FlatLayout.of([(3, 5), (7,), (1,), (4, 4), (2, 3, 2)], shards)
    assert layout.numel == 15 + 7 + 1 + 16 + 12
    assert layout.padded_numel % shards == 0 and layout.padded_numel - layout.numel < shards
    covered = {i: [] for i in range(5)}
    for s in range(shards):
        lo, hi = layout.shard_range(s)
        assert hi - lo == layout.shard_numel
        pos = 0
        for seg in layout.segments(s):
            assert seg.shard_start >= pos  # in order, no overlap inside a shard
            pos = seg.shard_start + seg.numel
            covered[seg.param_index].append((seg.param_start, seg.param_end))
            # the segment sits where the flat offset says it does
            assert lo + seg.shard_start == layout.offsets[seg.param_index] + seg.param_start
    for i, ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == layout.numels[i]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert layout.owners(i) == sorted({s for s in range(shards)
                                           for seg in layout.segments(s) if seg.param_index == i})


def test_empty_and_errors():
    assert FlatLayout.of([], 3).padded_numel == 3
    with pytest.raises(ValueError):
        FlatLayout.of([(2,)], 0)
    with pytest.raises(IndexError):
        FlatLayout.of([(2,)], 2).shard_range(2)


def test_chunk_ranges():
    assert chunk_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
