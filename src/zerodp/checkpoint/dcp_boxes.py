"""A flat element range of a tensor as N-d boxes, and the DCP planners that write and read such boxes.

torch's distributed checkpoint (DCP) stores a tensor as chunks that are N-d boxes (offsets and sizes per
dimension), and reshards by intersecting boxes. A zerodp rank owns a *flat* element range [start, end) of
each parameter (its segment of a flat unit, `partition.Segment`), which is not a box in general: a range
that starts and ends inside rows of a (rows, cols) matrix is a partial row, whole rows and another partial
row. `flat_range_boxes` cuts any range into at most 2 * ndim - 1 boxes, each of them a *contiguous* run of
the flat range, so every box is a plain view `flat[lo:hi].view(sizes)` of zerodp's shard: nothing is copied
or gathered to write or read it.

The planners extend torch's default ones by these boxes: `BoxSavePlanner` adds one SHARD write per box (as
DTensor shards are written), and `BoxLoadPlanner` adds reads for the boxes a rank wants, which torch's
resharding (`create_read_items_for_chunk_list`) satisfies from whatever boxes the checkpoint holds (FSDP2's
row blocks, zerodp's ranges at another world size). The rest of the state dict (steps, buffers, param groups)
goes through the default planners unchanged.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


class Box(NamedTuple):
    """Elements [lo, hi) of a flattened tensor, which form the box at `offsets` of `sizes`."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    lo: int
    hi: int


def flat_range_boxes(shape, start: int, end: int) -> list[Box]:
    """Boxes covering elements [start, end) of a row-major tensor of `shape`, in order, each contiguous."""
    shape = tuple(shape)
    if start >= end:
        return []
    if not shape:
        return [Box((), (), start, end)]
    if len(shape) == 1:
        return [Box((start,), (end - start,), start, end)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    boxes = []

    def rows_of(row: int, lo: int, hi: int) -> None:  # part of one row: the boxes of the inner shape
        for b in flat_range_boxes(shape[1:], lo - row * inner, hi - row * inner):
            boxes.append(Box((row,) + b.offsets, (1,) + b.sizes, b.lo + row * inner, b.hi + row * inner))

    at = start
    if at % inner:  # a partial first row
        row = at // inner
        stop = min(end, (row + 1) * inner)
        rows_of(row, at, stop)
        at = stop
    full_end = end // inner * inner
    if at < full_end:  # whole rows
        boxes.append(Box((at // inner,) + (0,) * (len(shape) - 1), ((full_end - at) // inner,) + shape[1:],
                         at, full_end))
        at = full_end
    if at < end:  # a partial last row
        rows_of(at // inner, at, end)
    return boxes


class BoxTensor(NamedTuple):
    """One box of the state-dict entry `key` (a tensor of `global_shape`) and the tensor holding its values."""

    offsets: tuple[int, ...]
    tensor: torch.Tensor       # shaped like the box: a view of a flat shard


class BoxSavePlanner(DefaultSavePlanner):
    """The default save planner, plus `boxes` ({key: (global shape, [BoxTensor])}) written as shards."""

    def __init__(self, boxes: dict[str, tuple[tuple[int, ...], list[BoxTensor]]]) -> None:
        super().__init__()
        self.boxes = boxes
        self._by_index = {(key, tuple(b.offsets)): b.tensor for key, (_, bs) in boxes.items() for b in bs}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        for key, (shape, boxes) in self.boxes.items():
            for b in boxes:
                offsets = torch.Size(b.offsets)
                items.append(WriteItem(
                    index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=b.tensor.shape),
                                                properties=TensorProperties.create_from_tensor(b.tensor),
                                                size=torch.Size(shape))))
        self.plan = SavePlan(items, storage_data=plan.storage_data, planner_data=plan.planner_data,
                             usable=plan.usable)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        found = self._by_index.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
        return found if found is not None else super().resolve_data(write_item)


class BoxLoadPlanner(DefaultLoadPlanner):
    """The default load planner, plus `boxes` ({key: [BoxTensor]}) filled from the checkpoint's chunks of `key`,
    whatever their shapes (torch's resharding)."""

    def __init__(self, boxes: dict[str, list[BoxTensor]]) -> None:
        super().__init__()
        self.boxes = boxes

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        for key, boxes in self.boxes.items():
            md = self.metadata.state_dict_metadata[key]
            assert isinstance(md, TensorStorageMetadata), key  # checked by the caller, with a message
            chunks = [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=b.tensor.shape) for b in boxes]
            items += create_read_items_for_chunk_list(key, md, chunks)
        self.plan = LoadPlan(items, storage_data=plan.storage_data, planner_data=plan.planner_data)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        boxes = self.boxes.get(index.fqn)
        if boxes is None:
            return super().lookup_tensor(index)
        box = boxes[index.index]  # the local chunk's position, as create_read_items_for_chunk_list numbers them
        assert tuple(box.offsets) == tuple(index.offset), (index, box.offsets)
        return box.tensor
