"""A flat element range cut into DCP boxes (checkpoint/dcp_boxes.py): exact cover, each box contiguous."""

import math
import random

import pytest
import torch

from zerodp.checkpoint.dcp_boxes import flat_range_boxes


def _check(shape, start, end):
    boxes = flat_range_boxes(shape, start, end)
    numel = math.prod(shape)
    index = torch.arange(numel).view(shape) if shape else torch.tensor(0)
    at = start
    for box in boxes:
        assert box.lo == at and box.hi > box.lo  # in order, no gap, never empty
        region = index[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))] if shape else index
        # the box is exactly the flat run [lo, hi): a view of a flat shard can fill it
        assert torch.equal(region.reshape(-1), torch.arange(box.lo, box.hi)), (shape, start, end, box)
        at = box.hi
    assert at == end or (start == end and not boxes)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


@pytest.mark.parametrize("shape", [(23,), (23, 12), (5, 23), (3, 4, 5), (2, 3, 4, 5), (1, 7), (7, 1)])
def test_every_range_is_covered_by_contiguous_boxes(shape):
    numel = math.prod(shape)
    rng = random.Random(0)
    ranges = [(0, numel), (0, 1), (numel - 1, numel)] + [tuple(sorted(rng.sample(range(numel + 1), 2)))
                                                          for _ in range(40)]
    for start, end in ranges:
        _check(shape, start, end)


def test_a_partial_row_range_is_three_boxes():
    boxes = flat_range_boxes((4, 10), 7, 33)
    assert [(b.offsets, b.sizes) for b in boxes] == [((0, 7), (1, 3)), ((1, 0), (2, 10)), ((3, 0), (1, 3))]


def test_a_scalar_is_one_box():
    assert [(b.offsets, b.sizes) for b in flat_range_boxes((), 0, 1)] == [((), ())]
