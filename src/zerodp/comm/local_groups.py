"""Communicators that only some ranks make: `local_group` and `give_back`.

[Note: local communicators] A communicator over a subgroup's ranks is made by those ranks alone (torch's
`new_group(..., use_local_synchronization=True)`): the other ranks are busy with their own subgroups. torch
names such a communicator by a hash of its ranks and of the number of live process groups in the process,
and its rendezvous keys live under that name in the default group's store. Destroy one and make another over
the same ranks, and the count is the same again: the new communicator gets the dead one's name, reads the
dead one's addresses from the store, and gloo connects to closed ports or hangs (tests/dist/
test_local_groups.py hung with 4 ranks before this module; an engine closed and built again over a
tensor-parallel job's data-parallel group, or over MiCS blocks of a subgroup, does exactly that).

So zerodp never destroys a communicator made this way while the default group lives: `give_back` keeps it,
and the next `local_group` over the same ranks and backend takes it again. Since nothing of ours is destroyed,
the live-group count only grows while we make communicators, and no name repeats. The subgroup's ranks make
and give back in one order (the collective contract), so they take the same communicator back. The kept
ones go with the default group: `dist.destroy_process_group()` destroys every group, and a new default group
starts an empty pool. Communicators that every rank makes (counter-named, never repeated while the default
group lives) are not kept: they are destroyed as before (comm/process_group.py `destroy_group`).
"""

from __future__ import annotations

import collections

import torch.distributed as dist

from . import process_state
from .communicator import new_group


class _Pool:
    """The communicators given back, per (ranks, backend), for one default group."""

    def __init__(self, world: dist.ProcessGroup) -> None:
        self.world = world  # the default group they were made under (a new one starts a new pool)
        self.free: dict[tuple, list[dist.ProcessGroup]] = collections.defaultdict(list)
        self.made: dict[int, tuple] = {}  # id(communicator) -> its key, for every one this pool made


def _current_pool() -> _Pool:
    """The pool of the live default group, kept in the Runtime's CommState (process_state.py)."""
    state = process_state.current()
    world = dist.group.WORLD
    if state.local_pool is None or state.local_pool.world is not world:
        state.local_pool = _Pool(world)  # the default group was destroyed (and with it every kept communicator)
    return state.local_pool


def local_group(ranks: list[int], backend: str) -> dist.ProcessGroup:
    """A communicator over `ranks` (global ranks) that only those ranks make; one given back earlier over
    the same ranks and backend when there is one ([Note: local communicators])."""
    pool = _current_pool()
    key = (tuple(sorted(ranks)), str(backend))
    if pool.free[key]:
        return pool.free[key].pop()
    group = new_group(list(ranks), backend, local=True)
    pool.made[id(group)] = key
    return group


def give_back(group: dist.ProcessGroup) -> bool:
    """Keep `group` for the next `local_group` over its ranks, if this pool made it; False when it did not
    (the caller destroys it as usual)."""
    pool = _current_pool()
    key = pool.made.get(id(group))
    if key is None:
        return False
    if all(kept is not group for kept in pool.free[key]):
        pool.free[key].append(group)
    return True
