"""Prefetch: gather the units that ran next last time, ahead of need, within a budget.

The order in which module units are acquired is recorded per pass: in forward (from the root's
pre-hook to its post-hook) and in backward (by their pre-backward events). When a unit is acquired,
the units that followed it in the *previous* pass of the same kind are gathered asynchronously, so
their all-gathers overlap the current unit's compute. Nothing is prefetched on the first step.

Budget, in elements of gathered (full) parameters, persistent units excluded:
    ahead  = elements prefetched and not yet acquired   <= stage3_prefetch_bucket_size
    live   = every gathered buffer alive, held or not    <= stage3_max_live_parameters
Prefetch stops at the first unit that would break either bound (units are never skipped: an
out-of-order gather only wastes memory). Gathers a forward or backward *needs* always proceed,
so the live bound is max(stage3_max_live_parameters, what the model's nesting needs at once: the
root's parameters plus the largest unit below it, for a flat stack of blocks).

A different order on a later step (a module skipped, another branch taken) stays correct: a
mispredicted prefetch is released unused when the pass ends, and every needed unit is gathered on
demand. Decisions depend only on the recorded order and on sizes, so every rank issues the same
gathers in the same order.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING, Optional

from .flat_unit import ShardState

if TYPE_CHECKING:
    from .flat_unit import FlatUnit
    from .module_unit import ModuleUnit
    from .shard_group import ShardGroup


class Pass(Enum):
    FORWARD = auto()
    BACKWARD = auto()


class ExecutionOrder:
    """First-use order of module units in the last completed forward and backward passes."""

    def __init__(self) -> None:
        self._last: dict[Pass, list["ModuleUnit"]] = {Pass.FORWARD: [], Pass.BACKWARD: []}
        self._position: dict[Pass, dict[int, int]] = {Pass.FORWARD: {}, Pass.BACKWARD: {}}
        self._current: dict[Pass, tuple[list, set]] = {}

    def start(self, kind: Pass) -> None:
        self._current[kind] = ([], set())

    def record(self, kind: Pass, unit: "ModuleUnit") -> None:
        current = self._current.get(kind)
        if current is not None and id(unit) not in current[1]:
            current[0].append(unit)
            current[1].add(id(unit))

    def finish(self, kind: Pass) -> None:
        current = self._current.pop(kind, None)
        if current is not None and current[0]:
            self._last[kind] = current[0]
            self._position[kind] = {id(u): i for i, u in enumerate(current[0])}

    def last(self, kind: Pass) -> list["ModuleUnit"]:
        return self._last[kind]

    def following(self, kind: Pass, unit: "ModuleUnit") -> list["ModuleUnit"]:
        """The units that came after `unit` last time (empty if it did not run)."""
        pos: Optional[int] = self._position[kind].get(id(unit))
        return [] if pos is None else self._last[kind][pos + 1:]


class Prefetcher:
    """Issues the asynchronous gathers of upcoming units within the budget (module docstring)."""

    def __init__(self, order: ExecutionOrder, bucket_numel: int, max_live_numel: int, shards: "ShardGroup") -> None:
        self.order = order
        self.bucket_numel = bucket_numel
        self.max_live_numel = max_live_numel
        self.shards = shards
        self._ahead: list["FlatUnit"] = []

    def ahead_numel(self) -> int:
        """Elements prefetched and not yet acquired (nor released unused)."""
        self._ahead = [f for f in self._ahead if f.holders == 0 and f.state is not ShardState.SHARDED]
        return sum(f.layout.padded_numel for f in self._ahead)

    def after(self, kind: Pass, unit: "ModuleUnit") -> None:
        """`unit` was just acquired: start gathering the units that followed it last time."""
        if self.bucket_numel <= 0:
            return
        ahead = self.ahead_numel()
        for upcoming in self.order.following(kind, unit):
            todo = [f for f in upcoming.gather_set if f.state is ShardState.SHARDED and not f.persistent]
            numel = sum(f.layout.padded_numel for f in todo)
            if numel == 0:
                continue
            if ahead + numel > self.bucket_numel or self.shards.live_numel + numel > self.max_live_numel:
                break
            for f in todo:
                f.unshard()
                self._ahead.append(f)
            ahead += numel
