"""Where a stage-3 step is: the pass running, the module units whose forward runs, what comes next.

One `Schedule` per model, shared by its module units (passed at their construction) and driven by
the strategy (`start_backward`, `finish_backward`). It owns:
    in_backward     set between engine.backward's start and its finish_micro_step
    the stack       module units whose forward is running now (innermost last)
    the order       first-use order of module units per pass (`prefetch.ExecutionOrder`)
    the prefetcher  gathers of the units that followed the current one last time (`prefetch.Prefetcher`)
    the cache       units kept gathered between inference forwards (`inference_cache.InferenceCache`):
                    each root forward begins an inference pass or, in training, releases them all

Calls run one way: module units tell the schedule what happens; the schedule reads module units'
gather sets and starts or releases flat units' gathers; it never calls back into the strategy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .flat_unit import FlatUnit, ShardState
from .inference_cache import InferenceCache, is_inference_forward
from .prefetch import ExecutionOrder, Pass, Prefetcher
from .shard_group import ShardGroup

if TYPE_CHECKING:  # annotations only: module units call the schedule, never the reverse
    from .module_unit import ModuleUnit


class Schedule:
    """The pass state of one stage-3 model; see the module docstring."""

    def __init__(self, flats: list[FlatUnit], shards: ShardGroup, prefetch_numel: int, max_live_numel: int,
                 inference: InferenceCache) -> None:
        self.flats = flats
        self.order = ExecutionOrder()
        self.prefetcher = Prefetcher(self.order, prefetch_numel, max_live_numel, shards)
        self.inference = inference
        self.in_backward = False
        self._stack: list["ModuleUnit"] = []

    @property
    def pass_kind(self) -> Pass:
        return Pass.BACKWARD if self.in_backward else Pass.FORWARD

    def running_unit(self) -> Optional["ModuleUnit"]:
        """The innermost module unit whose forward is running, if any."""
        return self._stack[-1] if self._stack else None

    # -- told by module units ---------------------------------------------------------------------

    def enter_forward(self, unit: "ModuleUnit") -> None:
        if not self._stack and not self.in_backward and unit.is_root:
            if is_inference_forward(unit.module):
                self.inference.begin_pass()
            else:
                self.inference.release_all()  # training resumes: nothing stays gathered past its use
            self.order.start(Pass.FORWARD)
        self._stack.append(unit)
        self.order.record(self.pass_kind, unit)

    def exit_forward(self, unit: "ModuleUnit") -> None:
        while self._stack and self._stack.pop() is not unit:
            pass  # a forward that raised may leave inner units behind
        if not self._stack and not self.in_backward and unit.is_root:
            self.order.finish(Pass.FORWARD)
            self.reshard_unheld()  # prefetches the forward did not use

    def keep_after_forward(self, unit: "ModuleUnit") -> None:
        """`unit`'s inference forward ends: the cache may keep its flat units gathered (before their release)."""
        if not self.in_backward and is_inference_forward(unit.module):
            self.inference.keep_after_forward(unit.gather_set)

    def record_backward(self, unit: "ModuleUnit") -> None:
        if self.in_backward:
            self.order.record(Pass.BACKWARD, unit)

    def ended_last_forward(self, unit: "ModuleUnit") -> bool:
        """`unit` was the last module unit to start its forward in the previous forward pass."""
        last = self.order.last(Pass.FORWARD)
        return bool(last) and last[-1] is unit

    def prefetch_after(self, unit: "ModuleUnit") -> None:
        self.prefetcher.after(self.pass_kind, unit)

    # -- driven by the strategy --------------------------------------------------------------------

    def start_backward(self) -> None:
        if self._stack:
            raise RuntimeError("zerodp stage 3: engine.backward was called inside the model's forward")
        self.in_backward = True
        self.order.start(Pass.BACKWARD)

    def finish_backward(self) -> None:
        self.reshard_unheld()
        self.order.finish(Pass.BACKWARD)
        self.in_backward = False

    def reshard_unheld(self) -> None:
        """Release every gathered flat unit nobody holds (unused prefetches)."""
        for f in self.flats:
            if f.holders == 0 and f.state is not ShardState.SHARDED:
                f.reshard()
