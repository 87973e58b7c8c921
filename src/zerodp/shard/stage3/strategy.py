"""The stage-3 sharding strategy (Pos+g+p): `Stage3Sharding`, what the engine drives.

The engine drives it through `seams.ShardingStrategy`, as it drives the stage 0-2 `GradReducer`.
Calls run one way: strategy -> module units (module_unit.py) -> flat units (flat_unit.py) -> shard
group (shard_group.py); the module units share a `Schedule` (schedule.py) given at construction.
The strategy is also the `ShardContext` of its parameters (params.py): a read of a sharded
parameter inside a forward, `gathered_parameters` and its writes reach it through the registry.
`partition.py` builds it from a model.

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
before it were launched; whatever is left goes at the end of backward (finish_micro_step), after one
small control all-reduce (`grads.reduce_queue.ReduceQueue.finish`) tells
every rank how many rounds each unit needs (a "late" gradient after a unit's launch, as in a
weight used by two re-entrant checkpointed regions, needs a second round). It launches round
by round, in unit order, so the sequence of reductions is the same on every rank whatever each
rank launched early. A unit also ends its round when its module unit's backward ends (every rank alike:
module_unit.py), parameters with no gradient on this rank reduced as zeros. At most
`grads.reduce_queue.MAX_INFLIGHT` reductions are in flight (none with overlap_comm=false: each is waited on as
soon as it is launched), and only reductions every rank launches in backward are waited on there ([Note: waiting
before the control collective] in grads/reduce_queue.py); a full gradient buffer
exists from a unit's first gradient of the micro-step until its reduction is waited on, so a unit
that never completes (a parameter unused in this micro-step) delays the units after it to the end
and keeps their buffers until then: correct, with less overlap and more memory.

Persistent units (the decision asked of `stage3_param_persistence_threshold`): their parameters
stay whole, but their gradients and optimizer state are sharded like any other unit's, rather
than all-reduced and stepped whole as in stage 0. They cost their full parameter bytes on every
rank (what memory_report shows on top of 16Psi/N) and 2 Psi_p of traffic per step instead of 3.
"""

from __future__ import annotations

import itertools
import logging
from typing import ContextManager, Optional

import torch
from torch import nn

from ..grads.param_hook import param_hook
from ..grads.reduce_queue import MAX_INFLIGHT, ReduceQueue
from ...offload.null_store import NullShardStore
from ...offload.shard_store import ShardStore
from ..seams import ParamOffload
from .flat_unit import FlatUnit
from .module_unit import ModuleUnit
from .params import register_owner, unregister_owner
from .prefetch import Pass
from .schedule import Schedule
from .shard_group import ShardGroup

log = logging.getLogger("zerodp")

_serial = itertools.count()  # orders strategies, so gathered_parameters gathers in one order everywhere


class Stage3Sharding:
    """Stage 3: module units gathered just in time, gradients reduce-scattered as they complete."""

    reduces_every_micro_step = True  # gradients are sharded: reduce after every micro-step

    def __init__(self, model: nn.Module, module_units: list[ModuleUnit], flats: list[FlatUnit],
                 shards: ShardGroup, schedule: Schedule, overlap_comm: bool = True,
                 param_home: Optional[ShardStore] = None, grad_home: Optional[ShardStore] = None) -> None:
        self.module = model
        # the stores its units' shards live in ([Note: a unit owns its residency] in flat_unit.py): the
        # units call them; the strategy only plans, reports and closes them (and tests read their counters)
        self.param_home = param_home if param_home is not None else NullShardStore()
        self.grad_home = grad_home    # fp32 offload_param nvme: the gradient shards' store, or None (in memory)
        self.max_inflight = MAX_INFLIGHT if overlap_comm else 0
        self.module_units = module_units
        self.root = module_units[0]
        self.flats = flats                                  # every flat unit, in index order
        self.units = [f for f in flats if f.trainable]      # what the optimizer steps
        self.frozen_units = [f for f in flats if not f.trainable]
        self.shards = shards
        self.state_group = shards.process_group  # every rank, or this rank's MiCS block ([Note: replicated shards])
        self.replica_index = shards.replicated.replica_index if shards.replicated is not None else 0
        self.schedule = schedule
        self.serial = next(_serial)
        device = shards.device
        self._owner = {id(f): mu for mu in module_units for f in mu.flats}  # flat unit -> its module unit
        grad_owner = {id(f.grads): mu for mu in module_units for f in mu.flats}
        self.queue = ReduceQueue(shards.control_group, device, async_op=True, max_inflight=self.max_inflight,
                                 reduce_all=False,
                                 launched_in_backward_everywhere=lambda g: grad_owner[id(g)].backward_end_seen)
        for mu in module_units:
            mu.reductions = self.queue
        self._held_until_backward_ends: list[FlatUnit] = []
        self._written: list[FlatUnit] = []
        self._hooks = []
        for f in flats:
            for p in f.params:
                register_owner(p, f, self)
        for f in self.units:
            for i, p in enumerate(f.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(f, i)))
        for mu in module_units:
            mu.register_hooks()

    # -- the parameter registry's context (params.ShardContext) ----------------------------------------

    def gather_on_access(self, flat: FlatUnit, owners: list) -> bool:
        """A sharded parameter of `flat` was read: borrow it into the running unit, if any."""
        unit = self.schedule.running_unit()
        if unit is None:
            return False
        log.info("zerodp stage 3: module unit %r reads parameters of %r in its forward; it gathers them from now "
                 "on", unit.name, flat.module_name)
        unit.borrow(flat)
        return True

    def hold_until_backward_ends(self, flat: FlatUnit) -> None:
        """Keep `flat` gathered until the current (or next) backward ends (gathered_parameters)."""
        if flat not in self._held_until_backward_ends:
            flat.acquire()
            self._held_until_backward_ends.append(flat)

    def on_shard_written(self, flat: FlatUnit) -> None:
        """gathered_parameters wrote new values into `flat`'s shard; `take_written_units` reports it."""
        if flat.trainable and flat not in self._written:
            self._written.append(flat)

    def take_written_units(self) -> list[FlatUnit]:
        """Trainable units whose shards were written outside the optimizer since the last call."""
        written, self._written = self._written, []
        return written

    # -- gradients ----------------------------------------------------------------------------------

    def _grad_hook(self, flat: FlatUnit, index: int):
        # runs once per parameter per backward ([Note: hook cost] in grads/param_hook.py), refusing gradients
        # outside engine.backward (the schedule's in_backward)
        owner = self._owner[id(flat)]

        def on_complete() -> None:
            self.queue.launch_ready()
            owner.on_gradients_complete()
        return param_hook(flat.grads, index, self.schedule, on_complete)

    def _reduction_order(self) -> list[FlatUnit]:
        """Trainable flat units by reverse first use in the last forward, then the rest ([Note: reduction order])."""
        ordered, seen = [], set()
        for mu in reversed(self.schedule.order.last(Pass.FORWARD)):
            for f in mu.flats:
                if f.trainable and id(f) not in seen:
                    ordered.append(f)
                    seen.add(id(f))
        return ordered + [f for f in self.units if id(f) not in seen]

    def start_micro_step(self, reduce: bool) -> None:
        """Before loss.backward(): every stage-3 micro-step reduces (`reduce` is always True)."""
        self.release_kept_units()  # a backward precedes every optimizer step: kept values would go stale
        if self.grad_home is not None:
            self.grad_home.reserve()  # zeroed gradient files hold no disk until now (offload/shard_store.py)
        self.schedule.start_backward()
        self.queue.start([f.grads for f in self._reduction_order()])

    def finish_micro_step(self, boundary: bool) -> Optional[torch.Tensor]:
        """After loss.backward(): finish every reduction, release every gathered unit.

        At an accumulation boundary, returns per-parameter flags (units in order, layout order inside)
        saying whether the parameter got a gradient on any rank since the last step; None otherwise.
        """
        # the control collective also settles this step's gathers ([Note: mixed gathers] in gather_ledger.py)
        received = self.queue.finish(boundary, [f.grads for f in self.units], agreement=self.shards.ledger)
        self.shards.sync_all()
        for mu in self.module_units:
            mu.end_backward()
        for f in self._held_until_backward_ends:
            f.release()
        self._held_until_backward_ends.clear()
        self.schedule.finish_backward()
        return received

    # -- after the optimizer step ---------------------------------------------------------------------

    def after_step(self) -> None:
        """All-gather the updated shards of persistent units; sharded units are gathered when next used."""
        self.release_kept_units()
        for f in self.flats:
            f.drop_secondary()  # hpZ: the primaries changed ([Note: secondary shards])
        handles = [f.after_step_gather() for f in self.units if f.persistent]
        for h in handles:
            h.wait()

    def end_step(self) -> None:
        """An optimizer step ended (taken or skipped): this step's order of shard reads predicts the next
        one's ([Note: parameter read-ahead] in offload/shard_store.py)."""
        self.param_home.end_step()

    def release_kept_units(self) -> None:
        """Release every unit kept gathered between inference forwards (training resumes, or the
        parameters are about to change); see inference_cache.py."""
        self.schedule.inference.release_all()

    # -- residency and introspection ---------------------------------------------------------------------

    def all_resident(self, dirty: bool = False) -> ContextManager[None]:
        """Every parameter shard in memory for a block (full_state_dict reads them all at once)."""
        return self.param_home.all_resident(dirty=dirty)

    def param_offload(self) -> Optional[ParamOffload]:
        """offload_param: the stores' limit and files now, for memory_report; None when no shard is offloaded."""
        if not self.param_home.offloads:
            return None
        grads = self.grad_home.disk_bytes() if self.grad_home is not None else None
        return ParamOffload(self.param_home.limit_numel, self.param_home.disk_bytes(), grads)

    @property
    def live_numel(self) -> int:
        """Elements of gathered (full) parameters alive now, persistent units excluded."""
        return self.shards.live_numel

    @property
    def peak_live_numel(self) -> int:
        return self.shards.peak_live_numel

    def reset_peak(self) -> None:
        self.shards.peak_live_numel = self.shards.live_numel

    def prepare_for_compile(self) -> None:
        """Re-register every module unit's forward hooks so that they run eagerly between torch.compile'd
        graphs (torch.compiler.disable): dynamo cannot trace their state machine and storage swaps."""
        for mu in self.module_units:
            mu.remove_hooks()
            mu.register_hooks(eager_under_compile=True)

    def close(self) -> None:
        """Undo what construction installed: hooks, the parameter registry's entries, the reduction
        communicator, the offload files. Idempotent; the model's parameters stay sharded and offloaded
        shards are gone with their files (the engine cannot train after)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for mu in self.module_units:
            mu.remove_hooks()
        for f in self.flats:
            for p in f.params:
                unregister_owner(p)
        self.shards.close()
        if self.grad_home is not None:  # its files are in the parameter store's folder, closed next
            self.grad_home.close()
        self.param_home.close()
