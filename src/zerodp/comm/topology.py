"""Which node each rank runs on, and which collectives cross nodes.

The truth is the host each rank runs on: `learn_hosts(group)` gathers every rank's host name once (one small
all_gather_object, when zerodp creates the default group and when an engine is built over a group it did not
create) and ranks on one host are one node. The launcher's variables (torchrun's `LOCAL_WORLD_SIZE`, DeepSpeed's
per-node `LOCAL_SIZE`/`CROSS_SIZE`, SLURM's tasks per node, Open MPI's `OMPI_COMM_WORLD_LOCAL_SIZE`, read by
launch_env.py) are only hints: they answer before any host is known, and where they disagree with the hosts
one warning names both and the hosts win. `ZERODP_HOSTNAME` replaces this process's host name, so that one
machine can act as several nodes (tests, and a rehearsal of a multi-node job: set it per simulated node).

A node layout is `(ranks_per_node, nodes, uniform)`: uniform when every node runs ranks_per_node ranks
numbered consecutively (torchrun's numbering, `RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK`; srun's
block distribution), so a rank's node is `rank // ranks_per_node`.

Two uses:
- the traffic recorder (collectives.py) labels every collective intra- or inter-node by its group's
  span: the bytes of a collective whose group has ranks on two or more nodes count as inter-node
  (a ring or pairwise exchange over such a group sends across the slow link on every round);
- hierarchical modes (hpZ's secondary shards, MiCS's blocks and two-hop gathers) take groups of consecutive
  ranks, made by `consecutive_groups`, which every rank must call the same way, sized by `node_layout`.

Heterogeneous nodes (different rank counts per node), or ranks of one node not numbered consecutively
(srun's cyclic distribution), break the division; `node_layout()` says so (`uniform=False`) and
hierarchical modes refuse or warn on such a job.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import NamedTuple, Optional

import torch.distributed as dist

from . import process_state
from .communicator import new_group
from .launch_env import LaunchEnvironment, read_launch_environment
from .local_groups import local_group

log = logging.getLogger("zerodp")
HOSTNAME_ENV = "ZERODP_HOSTNAME"  # this process's host name, replaced (one machine acting as several nodes)


# no import of collectives.py: it labels every record with `crosses_nodes`, so this module sits below it


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _world(group) -> int:
    return dist.get_world_size(group) if _initialized() else 1


class NodeLayout(NamedTuple):
    ranks_per_node: int
    nodes: int
    uniform: bool  # every node runs ranks_per_node ranks, numbered consecutively (torchrun's numbering)


def host_name() -> str:
    """This process's host: ZERODP_HOSTNAME if set, else the machine's name."""
    return os.environ.get(HOSTNAME_ENV) or socket.gethostname()


class _Hosts(NamedTuple):
    """Global rank -> host, learned under one default group (a new default group forgets it). `world` is the
    default group's id(), not the group: a field holding the group would keep it alive past its destroy,
    and gloo aborts at interpreter exit when a group outlives its owner (tests/e2e/teardown_check.py). Kept in the
    Runtime's CommState (`hosts`, process_state.py): a fact about the running job, not configuration."""
    world: int
    of_rank: dict
    version: int


def _learned() -> Optional[_Hosts]:
    return process_state.current().hosts


def learn_hosts(group=None) -> NodeLayout:
    """Gather the host of every rank of `group` (one all_gather_object; every rank of `group` calls it) and return
    the group's node layout from them. Where the launcher's variables disagree, one warning (on the group's
    first rank) names both."""
    if not _initialized() or _world(group) == 1:
        return node_layout(group)
    names: list = [None] * _world(group)
    dist.all_gather_object(names, host_name(), group=group)  # note: a sync point, once per group creation / engine
    ranks = _ranks(group)
    state, hosts = process_state.current(), _learned()
    known = dict(hosts.of_rank) if hosts is not None and hosts.world == id(dist.group.WORLD) else {}
    known.update(zip(ranks, names))
    state.hosts = _Hosts(id(dist.group.WORLD), known, (hosts.version + 1) if hosts is not None else 1)
    layout = _from_hosts(names)
    if dist.get_rank(group) == 0:
        _report_disagreement(layout, names, read_hints(), whole_world=len(ranks) == dist.get_world_size())
    return layout


def forget_hosts() -> None:
    """Drop the learned hosts (the next layouts come from the hints until `learn_hosts` runs again)."""
    process_state.current().hosts = None


def read_hints() -> Optional[LaunchEnvironment]:
    """The launcher's view of this job (None where the environment cannot form one: no hint then)."""
    try:
        return read_launch_environment()
    except ValueError:
        return None


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _known_hosts(group) -> Optional[list]:
    """The hosts of `group`'s ranks in group order, if all were learned under the live default group."""
    hosts = _learned()
    if hosts is None or hosts.world != id(dist.group.WORLD):
        return None
    names = [hosts.of_rank.get(r) for r in _ranks(group)]
    return None if None in names else names


def _from_hosts(names: list) -> NodeLayout:
    counts: dict = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    per_node = counts[names[0]]
    same = all(c == per_node for c in counts.values())
    consecutive = same and all(names[i] == names[i - i % per_node] for i in range(len(names)))
    return NodeLayout(per_node, len(counts), consecutive)


def _from_hints(world: int) -> NodeLayout:
    hints = read_hints()
    per_node = hints.local_world_size if hints is not None and hints.local_world_size else world
    if per_node < 1 or world % per_node:
        return NodeLayout(per_node, 1, False)
    uniform = True
    if hints is not None and hints.node_rank is not None:
        uniform = hints.rank // per_node == hints.node_rank
    return NodeLayout(per_node, world // per_node, uniform)


def _report_disagreement(layout: NodeLayout, names: list, hints: Optional[LaunchEnvironment],
                         whole_world: bool) -> None:
    """One warning when the launcher's per-node or node count differs from the hosts'."""
    if hints is None or not whole_world:
        return
    said = []
    if hints.local_world_size is not None and hints.local_world_size != layout.ranks_per_node:
        said.append(f"{hints.local_world_size} ranks per node")
    if hints.nodes is not None and hints.nodes != layout.nodes:
        said.append(f"{hints.nodes} nodes")
    if not said:
        return
    counts = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    hosts = ", ".join(f"{n} on {h!r}" for h, n in counts.items())
    message = (f"zerodp: the launcher's variables say {' and '.join(said)} ({hints.describe()}), but the ranks run "
               f"on {len(counts)} host(s) ({hosts}); zerodp groups ranks by host (hpZ, MiCS, the traffic labels). "
               f"If the hosts are right, fix the launch; to act as several nodes on one machine, set "
               f"{HOSTNAME_ENV} per node")
    warned = process_state.current().warned
    if message not in warned:
        warned.add(message)
        log.warning(message)


def node_layout(group=None) -> NodeLayout:
    """The node layout of `group`'s ranks (the job's by default): from the hosts once learned, else the hints."""
    names = _known_hosts(group) if _initialized() else None
    if names is not None:
        return _from_hosts(names)
    return _from_hints(_world(group))


def crosses_nodes(group=None) -> bool:
    """Whether `group` has ranks on more than one node (its collectives use the inter-node link). Called for every
    recorded collective: answered from a cache keyed by the group and what the layout was read from."""
    if not _initialized() or _world(group) == 1:
        return False
    name = "world" if group is None else str(getattr(group, "group_name", id(group)))
    state = process_state.current()
    hosts = state.hosts
    learned = hosts is not None and hosts.world == id(dist.group.WORLD)
    key = (name, ("hosts", hosts.version) if learned else ("hints", node_layout().ranks_per_node))
    spans = state.spans  # (group name, what the layout was read from) -> crosses nodes
    if key not in spans:
        names = _known_hosts(group) if learned else None
        if names is not None:
            spans[key] = len(set(names)) > 1
        else:
            per_node = _from_hints(dist.get_world_size()).ranks_per_node
            spans[key] = len({r // per_node for r in _ranks(group)}) > 1
    return spans[key]


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
