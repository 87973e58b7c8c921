"""One flat unit of stage 3: the parameters of one module unit and one optimizer group, sharded.

A `FlatUnit` lays its parameters out in a padded flat buffer (`flat.layout.FlatLayout`, or `WholeTensorLayout` for whole-tensor optimizers) and keeps
only this rank's slice persistently:

    param_shard  shard_numel elements, param dtype   the real storage of this rank's parameters
    grad_shard   shard_numel elements, accum dtype   reduced, rank-averaged gradient, accumulated
                 (whole-tensor units: shard_size(rank), the tensors this rank owns, no padding)
    gathered     padded_numel elements               allocated only while the unit is gathered
    grad_full    padded_numel elements               allocated only between a unit's first
                                                     gradient of a micro-step and its reduction
    secondary    padded_numel / k elements           hpZ only: from a forward's gather to the
                                                     step; see [Note: secondary shards] (hpz.py)

so at rest it holds (param + grad) * Psi_unit / N bytes, the paper's Pos+g+p. The optimizer and
checkpoints see it through `seams.ShardedUnit`. Its gradients are a `grads.grad_shard.GradShard`
(the gradient life cycle every stage shares) that reduce-scatters through the `ShardGroup`.

[Note: a unit owns its residency] With offload_param, `param_shard` keeps its shape and views but
has storage only while its store holds it resident (offload/shard_store.py); in fp32 with nvme the
gradient shard too. The unit holds both stores (`param_home`: a `NullShardStore` when nothing is
offloaded; the gradient's inside its `GradShard`) and is the only thing above the offload package
that calls them (the strategy only plans, reports and closes them): callers hold a shard in memory
with `resident(dirty=...)` / `grad_resident()` and read the gradient's square norm with
`grad_square_norm()`, whether or not anything is offloaded.

Two variants share the class:
- persistent (every parameter below `stage3_param_persistence_threshold`): the gathered buffer is
  never freed and `param_shard` is a view of it; gradients are still reduce-scattered and the
  optimizer steps the shard; `Stage3Sharding.after_step` all-gathers the updated shards.
- frozen (requires_grad=False parameters): sharded and gathered like the others, no gradient
  storage at all, never seen by the optimizer.

Parameter states (asserted): SHARDED -> GATHERING -> GATHERED -> SHARDED; gradient states are
`GradShard`'s; between inference forwards a GATHERED unit may be KEPT (inference_cache.py's `Residency`). A flat unit knows nothing above it: module units acquire and release it, the strategy
launches its reductions, and the parameter registry (params.py) routes reads of its sharded
parameters to the strategy.
"""

from __future__ import annotations

import contextlib
import time
from enum import Enum, auto
from typing import ContextManager, Optional

import torch
from torch import nn

from ... import comm
from ...host_memory import free_storage
from ..flat.buffer import FlatBuffer
from ..grads.grad_arithmetic import GradArithmetic
from ..grads.grad_shard import GradShard
from ..flat.whole_tensor_layout import layout_of
from ...offload.null_store import NullShardStore
from ...offload.shard_store import ShardStore
from .inference_cache import Residency
from .params import owner_of, set_partitioned
from .shard_group import ShardGroup, UnitReduction


class ShardState(Enum):
    SHARDED = auto()    # only param_shard holds values; the gathered buffer has no storage
    GATHERING = auto()  # all-gather in flight
    GATHERED = auto()   # the parameters hold their full values


class FlatUnit:
    """The parameters of one (module unit, optimizer group) pair, flat and sharded over `shards`."""

    def __init__(self, params: list[nn.Parameter], names: list[str], group_index: int, shards: ShardGroup, *,
                 index: int, module_name: str, trainable: bool, persistent: bool,
                 whole_tensors: bool = False, owner_loads=None, param_home: Optional[ShardStore] = None,
                 grad_home: Optional[ShardStore] = None,
                 arithmetic: Optional[GradArithmetic] = None, round_views: bool = False) -> None:
        if not params:
            raise ValueError("a FlatUnit needs at least one parameter")
        self.params = params
        self.names = names
        self.group_index = group_index   # -1 for frozen units
        self.shards = shards
        self.index = index               # position among the model's flat units (a stable order on every rank)
        self.module_name = module_name   # the module unit whose forward gathers this unit
        self.trainable = trainable
        self.persistent = persistent
        # whole tensors: unpadded shards of unequal sizes, balanced on top of `owner_loads` (the elements each
        # rank owns in earlier units; flat/whole_tensor_layout.py's UnpaddedWholeTensorLayout)
        self.layout = layout_of([p.shape for p in params], shards.world, whole_tensors, owner_loads)
        # each rank's range of the flat buffer where shards differ in size (None: equal shards)
        self._ranges = None if self.layout.even_shards else self.layout.shard_ranges()
        self.shard_index = shards.rank
        first = params[0]
        dtype, device = first.dtype, first.device
        self.gathered = FlatBuffer(self.layout, dtype, device)
        for i, p in enumerate(params):
            source = owner_of(p)
            if source is not None:  # created partitioned by init_context: gathered one parameter at a time
                source.gather_into(self.gathered.view(i))
            else:
                self.gathered.view(i).copy_(p.detach())
        self.gathered.zero_padding()
        self._classes = [type(p) for p in params]
        own = self.gathered.shard(self.shard_index)
        # A persistent unit's shard is a view of its always-gathered buffer; otherwise the shard is its
        # own storage, the only copy of these values that outlives a gather.
        self.param_shard = own if persistent else own.clone()
        for p, view in zip(params, self.gathered.views()):
            p.data = view  # forever: see [Note: partitioned parameters]
        # Frozen units have no gradient storage at all; a sharded unit's may live in `grad_home` (an
        # offload.ShardStore, see [Note: gradient shards offloaded]) between uses.
        self.grads: Optional[GradShard] = GradShard(
            params, self.layout, self.shard_index, arithmetic or GradArithmetic(shards.data_parallel_world),
            UnitReduction(shards, self.describe(), self._ranges), keep_full=False, name=f"{module_name}[{index}]",
            home=None if persistent or whole_tensors else grad_home, round_views=round_views) if trainable else None
        self._gather_handle = None
        shards.ledger.register(index, f"'{module_name}' (flat unit {index}, {self.layout.numel} elements)")
        self.secondary_shard: Optional[torch.Tensor] = None  # hpZ: see [Note: secondary shards]
        # where param_shard's storage lives between uses ([Note: a unit owns its residency])
        self.param_home = param_home if param_home is not None else NullShardStore()
        self.holders = 0                 # module units (and gathered_parameters blocks) using the values now
        self.residency = Residency.TRANSIENT  # KEPT: the inference cache holds it gathered (inference_cache.py)
        self.state = ShardState.GATHERED
        if not persistent:
            self.shards.live_numel += self.layout.padded_numel  # gathered since construction
            self.holders = 1
            self.release()
            self.param_home.adopt(self.param_shard)  # offload_param: the shard moves to its offloaded home now

    # -- accounting (the optimizer and memory_report read these) --------------------------------

    def param_bytes(self) -> int:
        """Parameter bytes held now: the shard (unless offloaded now), plus the gathered buffer while allocated."""
        shard = 0 if self.persistent else self.param_shard.numel() * self.param_shard.element_size()
        shard -= self.param_home.offloaded_bytes(self.param_shard)
        if self.secondary_shard is not None:
            shard += self.secondary_shard.numel() * self.secondary_shard.element_size()
        return shard + self.gathered.nbytes

    def grad_bytes(self) -> int:
        """Gradient bytes held now: the shard, plus the full gradient buffer while one is pending."""
        return self.grads.nbytes if self.grads is not None else 0

    @property
    def grad_shard(self) -> torch.Tensor:
        """This rank's reduced, rank-averaged gradients (trainable units)."""
        return self.grads.shard

    # -- residency ([Note: a unit owns its residency]) ----------------------------------------------

    @property
    def param_offloaded(self) -> bool:
        """param_shard has storage only inside `resident()` (offload_param, sharded units)."""
        return self.param_home.holds(self.param_shard)

    @property
    def grad_offloaded(self) -> bool:
        """grad_shard has storage only inside `grad_resident()` (fp32 offload_param nvme)."""
        return self.grads is not None and self.grads.offloaded

    def resident(self, dirty: bool = False) -> ContextManager[None]:
        """Hold param_shard in memory for a block; `dirty`: the block writes it (written back when evicted)."""
        return self.param_home.resident([self.param_shard], dirty=dirty)

    def grad_resident(self) -> ContextManager[None]:
        """Hold grad_shard in memory for a block (the block reads it)."""
        return self.grads.resident() if self.grads is not None else contextlib.nullcontext()

    def grad_square_norm(self) -> torch.Tensor:
        """float64 square of grad_shard's 2-norm; an offloaded shard's is kept from its delivery, not read."""
        return self.grads.shard_square_norm()

    def name_of(self, param: torch.Tensor) -> str:
        for p, name in zip(self.params, self.names):
            if p is param:
                return name
        return "<unknown>"

    # -- gathering ---------------------------------------------------------------------------------

    def unshard(self) -> None:
        """Start gathering the full parameters (no-op when gathered or in flight)."""
        if self.state is not ShardState.SHARDED:
            return
        self.shards.ledger.record(self.index)  # [Note: mixed gathers] in gather_ledger.py
        if self.secondary_shard is not None:  # hpZ: the same values, gathered inside the block
            self._gather_handle = self.shards.unshard(self.gathered.tensor, self.secondary_shard, what=self.describe(),
                                                      secondary=True)
            self.state = ShardState.GATHERING
            return
        self.param_home.acquire(self.param_shard)  # offload_param: read in (or ahead) before it is sent
        self._gather_handle = self.shards.unshard(self.gathered.tensor, self.param_shard, what=self.describe(),
                                                  ranges=self._ranges)
        self.state = ShardState.GATHERING

    def wait_for_unshard(self) -> None:
        """Finish the gather; the parameters then hold their full values."""
        if self.state is ShardState.GATHERING:
            start = time.perf_counter()
            self._gather_handle.wait()
            self.shards.gather_wait_s += time.perf_counter() - start
            self._gather_handle = None
            if self.secondary_shard is None:  # offload_param: the gather no longer reads the shard
                self.param_home.release(self.param_shard)
            set_partitioned(self.params, self._classes)
            self.state = ShardState.GATHERED

    def reshard(self) -> None:
        """Release the gathered storage (not for persistent units); see [Note: freeing storage]."""
        if self.persistent or self.state is ShardState.SHARDED:
            return
        assert self.holders == 0, f"resharding {self.module_name} while {self.holders} users hold it"
        self.wait_for_unshard()  # never free a buffer a collective may still write
        self._keep_secondary()
        set_partitioned(self.params, None)
        # Setting p.data would only drop a reference: autograd's saved views keep the bytes alive.
        free_storage(self.gathered.tensor)
        self.shards.on_resharded(self.gathered.tensor)
        self.state = ShardState.SHARDED

    def _keep_secondary(self) -> None:
        """hpZ: keep this rank's slice of the block's copy before the gathered values are freed, if the
        parameters are being trained (autograd on: a backward will gather them again)."""
        secondary = self.shards.secondary
        if secondary is None or self.secondary_shard is not None or not torch.is_grad_enabled():
            return
        numel = self.layout.padded_numel // secondary.world
        self.secondary_shard = self.gathered.tensor.narrow(0, secondary.rank * numel, numel).clone()

    def drop_secondary(self) -> None:
        """hpZ: the shards changed (optimizer step, write-back, load): the next gather reads the primaries."""
        self.secondary_shard = None

    def acquire(self, wait: bool = True) -> None:
        """Hold the full parameters (gathering them if needed) until the matching `release`."""
        self.holders += 1
        self.unshard()
        if wait:
            self.wait_for_unshard()

    def release(self) -> None:
        """Drop one hold; the last one reshards."""
        assert self.holders > 0, f"release of {self.module_name} without a matching acquire"
        self.holders -= 1
        if self.holders == 0:
            self.reshard()

    def keep(self) -> None:
        """The inference cache takes one hold of the gathered values, beyond the forward that gathered them."""
        assert self.residency is Residency.TRANSIENT, f"{self.describe()} is already kept"
        assert self.state is ShardState.GATHERED and self.holders > 0, f"keeping {self.describe()} while not in use"
        self.holders += 1
        self.residency = Residency.KEPT

    def unkeep(self) -> None:
        """The inference cache gives its hold back (the unit reshards if nobody else holds it)."""
        assert self.residency is Residency.KEPT, f"{self.describe()} is not kept"
        self.residency = Residency.TRANSIENT
        self.release()

    def write_back(self, src: int) -> None:
        """Make rank `src`'s gathered values the new parameters: broadcast them and keep this rank's
        slice. Every rank must call it while gathered."""
        assert self.state is ShardState.GATHERED
        comm.broadcast(self.gathered.tensor, src, self.shards.control_group, tag="param")  # src: a rank of the job
        if not self.persistent:
            with self.resident(dirty=True):  # offload_param: written back to its home when evicted
                self.param_shard.copy_(self.gathered.shard(self.shard_index))
            self.drop_secondary()

    # -- gradients ---------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Forget gradients after an optimizer step (or a skipped one)."""
        self.grads.zero_grad()

    def after_step_gather(self):
        """Persistent units: start gathering the updated shards into the full parameters; returns the handle."""
        assert self.persistent
        if self._ranges is not None:
            return comm.all_gather_uneven(self.gathered.tensor, self.param_shard, self._ranges,
                                          self.shards.process_group, async_op=True, tag="param")
        return comm.all_gather(self.gathered.tensor, self.param_shard, self.shards.process_group,
                               async_op=True, tag="param")

    def describe(self) -> str:
        """How collectives name this unit in diagnostics (watchdog, debug_sync)."""
        return f"unit '{self.module_name}' (flat unit {self.index})"

    def __repr__(self) -> str:
        kind = "persistent" if self.persistent else ("frozen" if not self.trainable else "sharded")
        return (f"FlatUnit({self.index}, {self.module_name!r}, group={self.group_index}, {kind}, "
                f"numel={self.layout.numel}, {self.state.name})")
