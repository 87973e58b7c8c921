"""Which node each rank runs on, and which collectives cross nodes.

torchrun starts one agent per node; each agent's ranks get consecutive global ranks
(`RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK` when every node runs the same number of ranks),
so a rank's node is `rank // LOCAL_WORLD_SIZE`. zerodp reads the node layout from that environment
and nowhere else; without torchrun's variables every rank is on one node.

Two uses:
- the traffic recorder (collectives.py) labels every collective intra- or inter-node by its group's
  span: the bytes of a collective whose group has ranks on two or more nodes count as inter-node
  (a ring or pairwise exchange over such a group sends across the slow link on every round);
- hierarchical modes (hpZ's secondary shards) take groups of consecutive ranks, made by
  `consecutive_groups`, which every rank must call the same way.

Heterogeneous nodes (different rank counts per node) break the division; `node_layout()` says so
(`uniform=False`) and hierarchical modes refuse to start on such a job.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch.distributed as dist

from .communicator import new_group
from .local_groups import local_group


# no import of collectives.py: it labels every record with `crosses_nodes`, so this module sits below it


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _world(group) -> int:
    return dist.get_world_size(group) if _initialized() else 1


class NodeLayout(NamedTuple):
    ranks_per_node: int
    nodes: int
    uniform: bool  # every node runs ranks_per_node ranks, numbered consecutively (torchrun's numbering)


def node_layout() -> NodeLayout:
    """This job's node layout, from torchrun's environment (one node without it)."""
    world = _world(None)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    if per_node < 1 or world % per_node:
        return NodeLayout(per_node, 1, False)
    uniform = True
    if "GROUP_RANK" in os.environ and "RANK" in os.environ:
        uniform = int(os.environ["RANK"]) // per_node == int(os.environ["GROUP_RANK"])
    return NodeLayout(per_node, world // per_node, uniform)


_spans: dict[tuple, bool] = {}  # (group name, ranks per node) -> crosses nodes (a name is fixed by its ranks)


def crosses_nodes(group=None) -> bool:
    """Whether `group` has ranks on more than one node (its collectives use the inter-node link)."""
    if not _initialized() or _world(group) == 1:
        return False
    per_node = node_layout().ranks_per_node
    key = ("world" if group is None else str(getattr(group, "group_name", id(group))), per_node)
    if key not in _spans:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        _spans[key] = len({r // per_node for r in ranks}) > 1
    return _spans[key]


def consecutive_groups(size: int, group=None):
    """Split `group`'s ranks into blocks of `size` consecutive ranks; return this rank's block's group.

    Every rank of `group` must call it (each block's communicator is made by all of them, in one
    order). `size` must divide the group's world size.
    """
    world = _world(group)
    if size < 1 or world % size:
        raise ValueError(f"a block of {size} ranks does not divide the {world} ranks")
    if size == world:
        return group
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    # only the group's ranks call this: over a subgroup the blocks are made with local synchronization
    local = group is not None and group is not dist.group.WORLD
    me = dist.get_rank(group)
    mine = None
    for start in range(0, world, size):
        inside = start <= me < start + size
        if local and not inside:
            continue
        block = _make(ranks[start:start + size], group, local)
        if inside:
            mine = block
    return mine


def _make(ranks: list[int], group, local: bool):
    """A communicator over `ranks`: made by every rank of the job, or (`local`) by those ranks alone, then
    kept for reuse instead of destroyed ([Note: local communicators] in local_groups.py)."""
    backend = str(dist.get_backend(group))
    return local_group(ranks, backend) if local else new_group(ranks, backend)


def strided_groups(size: int, group=None):
    """The transpose of `consecutive_groups(size)`: ranks at the same position of every block of `size`
    (positions i, i + size, i + 2 size, ...); returns this rank's group. Every rank of `group` calls it."""
    world = _world(group)
    if size < 1 or world % size:
        raise ValueError(f"a block of {size} ranks does not divide the {world} ranks")
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    local = group is not None and group is not dist.group.WORLD
    me = dist.get_rank(group)
    mine = None
    for position in range(size):
        inside = me % size == position
        if local and not inside:
            continue
        made = _make(ranks[position::size], group, local)
        if inside:
            mine = made
    return mine


def subgroup_of(rank_lists: list[list[int]], group=None):
    """Make one communicator per list of ranks (ranks of `group`, by position) and return the one this rank is in
    (None if none). Every rank of the job calls it with the same lists, in the same order."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    me = dist.get_rank(group)
    mine = None
    for members in rank_lists:
        made = new_group([ranks[r] for r in members], str(dist.get_backend(group)))
        if me in members:
            mine = made
    return mine
