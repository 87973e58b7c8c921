"""The stage-3 sharding strategy (Pos+g+p): what the engine drives, and how it is built.

`build_stage3_sharding` turns a model into module units (wrap.py) holding flat units (units.py),
registers the hooks (hooks.py) and returns a `Stage3Sharding`, which the engine drives through
the same members as the stage 0-2 `buckets.GradReducer`: `units`, `frozen_units`,
`reduces_every_micro_step`, `start_micro_step`, `flush`, `after_step` and `attach_optimizer`.

Per step, for a unit of Psi_u elements on N ranks, the collectives are (the paper's 3 Psi):
    forward   all-gather Psi_u   (before its forward; freed after it)
    backward  all-gather Psi_u   (before its backward; freed after it)
    backward  reduce-scatter Psi_u of gradients (as soon as its last gradient arrives)
Persistent units (small parameters, kept whole) skip both gathers and are all-gathered once after
the optimizer step instead, like stage 2; their gradients are reduce-scattered like the others.

[Note: reduction order]
Reduce-scatters run on their own communicator (see [Note: two communicators]) and every rank
issues them in one order, fixed at the start of each backward: trainable flat units by reverse
first-use in the last forward (roughly the order backward completes them), then the rest. A unit
is launched during backward only when it is complete (every parameter reported) and all units
before it were launched; whatever is left goes at flush, after one small control all-reduce tells
every rank how many rounds each unit needs (a "late" gradient after a unit's launch, as in a
weight used by two re-entrant checkpointed regions, needs a second round). Flush launches round
by round, in unit order, so the sequence of reductions is the same on every rank whatever each
rank launched early. At most `_MAX_INFLIGHT` reductions are in flight (none with overlap_comm=false:
each is waited on as soon as it is launched); a full gradient buffer
exists from a unit's first gradient of the micro-step until its reduction is waited on, so a unit
that never completes (a parameter unused in this micro-step) delays the units after it to flush
and keeps their buffers until then: correct, with less overlap and more memory.

Persistent units (the decision asked of `stage3_param_persistence_threshold`): their parameters
stay whole, but their gradients and optimizer state are sharded like any other unit's, rather
than all-reduced and stepped whole as in stage 0. They cost their full parameter bytes on every
rank (what memory_report shows on top of 16Psi/N) and 2 Psi_p of traffic per step instead of 3.
"""

from __future__ import annotations

import collections
import itertools
import logging
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..config import ZeroConfig
from .flat_unit import FlatUnit, GradState, ShardState
from .module_unit import ModuleUnit
from .params import owner_of
from .prefetch import ExecutionOrder, Pass, Prefetcher
from .shard_group import ShardGroup
from .wrap import choose_unit_modules, plan_units

log = logging.getLogger("zerodp")

_MAX_INFLIGHT = 2
_serial = itertools.count()  # orders strategies, so gathered_parameters gathers in one order everywhere


class Stage3Sharding:
    """Stage 3: module units gathered just in time, gradients reduce-scattered as they complete."""

    reduces_every_micro_step = True  # gradients are sharded: reduce after every micro-step

    def __init__(self, model: nn.Module, module_units: list[ModuleUnit], flats: list[FlatUnit],
                 shards: ShardGroup, prefetch_numel: int, max_live_numel: int, overlap_comm: bool = True) -> None:
        self.module = model
        self.max_inflight = _MAX_INFLIGHT if overlap_comm else 0
        self.module_units = module_units
        self.root = module_units[0]
        self.flats = flats                                  # every flat unit, in index order
        self.units = [f for f in flats if f.trainable]      # what the optimizer steps
        self.frozen_units = [f for f in flats if not f.trainable]
        self.shards = shards
        self.serial = next(_serial)
        self.order = ExecutionOrder()
        self.prefetcher = Prefetcher(self.order, prefetch_numel, max_live_numel, shards)
        self.in_backward = False
        self._stack: list[ModuleUnit] = []      # module units whose forward is running
        self._reduce_order: list[FlatUnit] = list(self.units)
        self._next_launch = 0
        self._inflight: collections.deque[FlatUnit] = collections.deque()
        self._held_until_flush: list[FlatUnit] = []
        self._masters: dict[int, torch.Tensor] = {}
        self._hooks = []
        for f in flats:
            f.strategy = self
        for f in self.units:
            for i, p in enumerate(f.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(f, i)))
        for mu in module_units:
            mu.register_hooks()

    # -- forward bookkeeping (called by the module units' hooks) ----------------------------------

    def enter_forward(self, unit: ModuleUnit) -> None:
        if not self._stack and not self.in_backward and unit is self.root:
            self.order.start(Pass.FORWARD)
        self._stack.append(unit)
        self.order.record(Pass.BACKWARD if self.in_backward else Pass.FORWARD, unit)

    def exit_forward(self, unit: ModuleUnit) -> None:
        while self._stack and self._stack.pop() is not unit:
            pass  # a forward that raised may leave inner units behind
        if not self._stack and not self.in_backward and unit is self.root:
            self.order.finish(Pass.FORWARD)
            self._reshard_unheld()  # prefetches the forward did not use

    def record_backward(self, unit: ModuleUnit) -> None:
        if self.in_backward:
            self.order.record(Pass.BACKWARD, unit)

    def prefetch_after(self, unit: ModuleUnit) -> None:
        self.prefetcher.after(Pass.BACKWARD if self.in_backward else Pass.FORWARD, unit)

    def gather_on_access(self, flat: FlatUnit) -> bool:
        """A partitioned parameter of `flat` was read: borrow it into the running unit, if any."""
        if not self._stack:
            return False
        unit = self._stack[-1]
        log.info("zerodp stage 3: module unit %r reads parameters of %r in its forward; it gathers them from now "
                 "on", unit.name, flat.module_name)
        unit.borrow(flat)
        return True

    def hold_until_flush(self, flat: FlatUnit) -> None:
        """Keep `flat` gathered until the current (or next) backward ends (gathered_parameters)."""
        if flat not in self._held_until_flush:
            flat.acquire()
            self._held_until_flush.append(flat)

    def _reshard_unheld(self) -> None:
        for f in self.flats:
            if f.holders == 0 and f.state is not ShardState.SHARDED:
                f.reshard()

    # -- gradients ----------------------------------------------------------------------------------

    def _grad_hook(self, flat: FlatUnit, index: int):
        def hook(param: torch.Tensor) -> None:
            if not self.in_backward:
                raise RuntimeError("zerodp stage 3: a gradient was accumulated outside engine.backward(loss); "
                                   "call engine.backward(loss) instead of loss.backward()")
            flat.add_grad(index)
            if flat.complete:
                self._launch_ready()
                flat.module_unit.on_gradients_complete()
        return hook

    def _reduction_order(self) -> list[FlatUnit]:
        """Trainable flat units by reverse first use in the last forward, then the rest ([Note: reduction order])."""
        ordered, seen = [], set()
        for mu in reversed(self.order.last(Pass.FORWARD)):
            for f in mu.flats:
                if f.trainable and id(f) not in seen:
                    ordered.append(f)
                    seen.add(id(f))
        return ordered + [f for f in self.units if id(f) not in seen]

    def _launch_ready(self) -> None:
        order = self._reduce_order
        while self._next_launch < len(order):
            f = order[self._next_launch]
            if not (f.complete and f.grad_state is GradState.FILLING and f.rounds_launched == 0):
                return
            f.launch_reduce()
            self._inflight.append(f)
            self._next_launch += 1
            while len(self._inflight) > self.max_inflight:
                self._inflight.popleft().wait_reduce()

    def start_micro_step(self, reduce: bool) -> None:
        """Called before loss.backward(): every stage-3 micro-step reduces (`reduce` is always True)."""
        if self._stack:
            raise RuntimeError("zerodp stage 3: engine.backward was called inside the model's forward")
        self.in_backward = True
        self.order.start(Pass.BACKWARD)
        self._reduce_order = self._reduction_order()
        self._next_launch = 0
        for f in self.units:
            f.start_round()

    def flush(self, boundary: bool) -> Optional[torch.Tensor]:
        """After loss.backward(): finish every reduction, release every gathered unit.

        At an accumulation boundary, returns per-parameter flags (units in order, layout order inside)
        saying whether the parameter got a gradient on any rank since the last step; None otherwise.
        """
        order = self._reduce_order
        # One small control collective: how many reduction rounds each unit needs this micro-step,
        # and at the boundary which parameters got any gradient at all.
        need = [f.rounds_launched + (1 if f.grad_state is GradState.FILLING else 0) for f in order]
        parts = [torch.tensor(need, dtype=torch.float32)]
        if boundary:
            parts += [f.received.float() for f in self.units]
        # the backend's device (NCCL: CUDA); note: a sync point, the flags decide what runs next
        flags = torch.cat(parts).to(self.flats[0].param_shard.device)
        comm.all_reduce(flags, self.shards.process_group, op=dist.ReduceOp.MAX, tag="control")
        target = [int(t) for t in flags[:len(order)].tolist()]
        for round_ in range(1, max(target, default=0) + 1):  # round-major: see [Note: reduction order]
            for f, rounds in zip(order, target):
                if f.rounds_launched < round_ <= rounds:
                    f.wait_reduce()
                    f.launch_reduce()
        for f in order:
            f.wait_reduce()
        self._inflight.clear()
        self.shards.sync_all()
        for mu in self.module_units:
            mu.end_backward()
        for f in self._held_until_flush:
            f.release()
        self._held_until_flush.clear()
        self._reshard_unheld()
        self.order.finish(Pass.BACKWARD)
        self.in_backward = False
        return flags[len(order):] > 0 if boundary else None

    # -- after the optimizer step ---------------------------------------------------------------------

    def after_step(self) -> None:
        """All-gather the updated shards of persistent units; sharded units are gathered when next used."""
        handles = [f.after_step_gather() for f in self.units if f.persistent]
        for h in handles:
            h.wait()

    def attach_optimizer(self, optimizer) -> None:
        """Know the fp32 masters, so that writes through gathered_parameters reach them."""
        self._masters = {id(u): m for u, m in zip(optimizer.units, optimizer.masters)}

    def on_shard_written(self, flat: FlatUnit) -> None:
        master = self._masters.get(id(flat))
        if master is not None and master is not flat.param_shard:
            master.copy_(flat.param_shard)

    # -- introspection -------------------------------------------------------------------------------

    @property
    def live_numel(self) -> int:
        """Elements of gathered (full) parameters alive now, persistent units excluded."""
        return self.shards.live_numel

    @property
    def peak_live_numel(self) -> int:
        return self.shards.peak_live_numel

    def reset_peak(self) -> None:
        self.shards.peak_live_numel = self.shards.live_numel

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for mu in self.module_units:
            mu.remove_hooks()


def build_stage3_sharding(model: nn.Module, groups: list[list[nn.Parameter]], config: ZeroConfig,
                          process_group: comm.ProcessGroup) -> Stage3Sharding:
    """Partition `model`'s parameters into units and hook its modules (see the module docstring).

    `groups` are the optimizer's param groups, trainable parameters only, in model order.
    """
    zero = config.zero_optimization
    params = list(model.parameters())
    if not params:
        raise ValueError("zerodp stage 3: the model has no parameters")
    if any(isinstance(owner_of(p), FlatUnit) for p in params):
        raise ValueError("zerodp stage 3: the model is already partitioned by another engine")
    group_of = {id(p): gi for gi, g in enumerate(groups) for p in g}
    shards = ShardGroup(process_group, params[0].device, use_all_reduce=not zero.reduce_scatter)
    plans = plan_units(model, choose_unit_modules(model, zero.stage3_unit_modules, zero.stage3_unit_min_params))
    threshold = zero.stage3_param_persistence_threshold
    flats: list[FlatUnit] = []
    module_units: list[ModuleUnit] = []
    for plan in plans:
        buckets: dict[tuple, tuple[list, list]] = {}
        for p, name in zip(plan.params, plan.names):
            persistent = p.numel() < threshold
            if not p.requires_grad and persistent:
                continue  # small and frozen: stays whole, no unit, no state
            key = (group_of[id(p)] if p.requires_grad else -1, persistent, p.dtype, p.device)
            ps, ns = buckets.setdefault(key, ([], []))
            ps.append(p)
            ns.append(name)
        owned = []
        for (group_index, persistent, _, _), (ps, ns) in buckets.items():
            flat = FlatUnit(ps, ns, group_index, shards, index=len(flats), module_name=plan.name or "<root>",
                            trainable=group_index >= 0, persistent=persistent)
            flats.append(flat)
            owned.append(flat)
        if owned or plan.module is model:
            module_units.append(ModuleUnit(plan.module, plan.name, owned, None))
    strategy = Stage3Sharding(model, module_units, flats, shards, zero.stage3_prefetch_bucket_size,
                              zero.stage3_max_live_parameters, zero.overlap_comm)
    for mu in module_units:
        mu.strategy = strategy
    return strategy
