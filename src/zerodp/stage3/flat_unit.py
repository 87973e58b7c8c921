"""One flat unit of stage 3: the parameters of one module unit and one optimizer group, sharded.

A `FlatUnit` lays its parameters out in a padded flat buffer (`partition.FlatLayout`) and keeps
only this rank's slice persistently:

    param_shard  shard_numel elements, param dtype   the real storage of this rank's parameters
    grad_shard   shard_numel elements, param dtype   reduced, rank-averaged gradient, accumulated
    gathered     padded_numel elements               allocated only while the unit is gathered
    grad_full    padded_numel elements               allocated only between a unit's first
                                                     gradient of a micro-step and its reduction

so at rest it holds (param + grad) * Psi_unit / N bytes, the paper's Pos+g+p. The optimizer sees
it through the `optimizer.ShardedUnit` members (params, group_index, layout, shard_index,
param_shard, grad_shard, zero_grad, param_bytes, grad_bytes).

Two variants share the class:
- persistent (every parameter below `stage3_param_persistence_threshold`): the gathered buffer is
  never freed and `param_shard` is a view of it; gradients are still reduce-scattered and the
  optimizer steps the shard; `Stage3Sharding.after_step` all-gathers the updated shards.
- frozen (requires_grad=False parameters): sharded and gathered like the others, no gradient
  storage at all, never seen by the optimizer.

State transitions (asserted): SHARDED -> GATHERING -> GATHERED -> SHARDED, and for gradients
IDLE -> FILLING -> REDUCING -> REDUCED (-> FILLING again for a late gradient of the same
micro-step, e.g. a weight used in two re-entrant checkpointed regions).
"""

from __future__ import annotations

from enum import Enum, auto

import torch
from torch import nn

from .. import comm
from ..flat.buffer import FlatBuffer, alloc_storage, free_storage
from ..flat.layout import FlatLayout
from .shard_group import ShardGroup
from .params import owner_of, register_owner, set_partitioned


class ShardState(Enum):
    SHARDED = auto()    # only param_shard holds values; the gathered buffer has no storage
    GATHERING = auto()  # all-gather in flight
    GATHERED = auto()   # the parameters hold their full values


class GradState(Enum):
    IDLE = auto()       # no gradient this round
    FILLING = auto()    # some parameters reported
    REDUCING = auto()   # reduce-scatter in flight
    REDUCED = auto()    # this round's reduction is in grad_shard


class FlatUnit:
    """The parameters of one (module unit, optimizer group) pair, flat and sharded over `shards`."""

    def __init__(self, params: list[nn.Parameter], names: list[str], group_index: int, shards: ShardGroup, *,
                 index: int, module_name: str, trainable: bool, persistent: bool) -> None:
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
        self.module_unit = None          # set by the strategy: the ModuleUnit owning this flat unit
        self.strategy = None             # set by the strategy (lazy gathers, master updates)
        self.layout = FlatLayout.of([p.shape for p in params], shards.world)
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
        self.gathered.tensor[self.layout.numel:].zero_()
        self._classes = [type(p) for p in params]
        own = self.gathered.shard(self.shard_index)
        # A persistent unit's shard is a view of its always-gathered buffer; otherwise the shard is its
        # own storage, the only copy of these values that outlives a gather.
        self.param_shard = own if persistent else own.clone()
        for p, view in zip(params, self.gathered.views()):
            p.data = view  # forever: see [Note: partitioned parameters]
            register_owner(p, self)
        self.grad_full = FlatBuffer(self.layout, dtype, device)
        free_storage(self.grad_full.tensor)
        self.grad_shard = torch.zeros(self.layout.shard_numel if trainable else 0, dtype=dtype, device=device)
        self.received = torch.zeros(len(params), dtype=torch.bool)
        self.reported: set[int] = set()
        self.rounds_launched = 0
        self.grad_state = GradState.IDLE
        self._reduce_handle = None
        self._gather_handle = None
        self.holders = 0                 # module units (and gathered_parameters blocks) using the values now
        self.state = ShardState.GATHERED
        if not persistent:
            self.shards.live_numel += self.layout.padded_numel  # gathered since construction
            self.holders = 1
            self.release()

    # -- accounting (the optimizer and memory_report read these) --------------------------------

    def param_bytes(self) -> int:
        """Parameter bytes held now: the shard, plus the gathered buffer while it is allocated."""
        shard = 0 if self.persistent else self.param_shard.numel() * self.param_shard.element_size()
        return shard + self.gathered.nbytes

    def grad_bytes(self) -> int:
        """Gradient bytes held now: the shard, plus the full gradient buffer while one is pending."""
        return self.grad_shard.numel() * self.grad_shard.element_size() + self.grad_full.nbytes

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
        self._gather_handle = self.shards.unshard(self.gathered.tensor, self.param_shard)
        self.state = ShardState.GATHERING

    def wait_for_unshard(self) -> None:
        """Finish the gather; the parameters then hold their full values."""
        if self.state is ShardState.GATHERING:
            self._gather_handle.wait()
            self._gather_handle = None
            set_partitioned(self.params, self._classes)
            self.state = ShardState.GATHERED

    def reshard(self) -> None:
        """Release the gathered storage (not for persistent units); see [Note: freeing storage]."""
        if self.persistent or self.state is ShardState.SHARDED:
            return
        assert self.holders == 0, f"resharding {self.module_name} while {self.holders} users hold it"
        self.wait_for_unshard()  # never free a buffer a collective may still write
        set_partitioned(self.params, None)
        # Setting p.data would only drop a reference: autograd's saved views keep the bytes alive.
        free_storage(self.gathered.tensor)
        self.shards.on_resharded(self.gathered.tensor)
        self.state = ShardState.SHARDED

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

    def gather_on_access(self, owners=()) -> bool:
        """A partitioned parameter of this unit was read: gather on the spot if a forward is running."""
        return self.strategy is not None and self.strategy.gather_on_access(self)

    def write_back(self, src: int) -> None:
        """Make rank `src`'s gathered values the new parameters: broadcast them and keep this rank's
        slice (and, through the strategy, the fp32 master). Every rank must call it while gathered."""
        assert self.state is ShardState.GATHERED
        comm.broadcast(self.gathered.tensor, src, self.shards.process_group, tag="param")
        if not self.persistent:
            self.param_shard.copy_(self.gathered.shard(self.shard_index))
        if self.strategy is not None:
            self.strategy.on_shard_written(self)

    # -- gradients ---------------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        """Every parameter reported a gradient in this round."""
        return len(self.reported) == len(self.params)

    def _ensure_grad_full(self) -> None:
        if self.grad_full.nbytes == 0:
            alloc_storage(self.grad_full.tensor, self.layout.padded_numel)
            self.grad_full.tensor.zero_()

    def add_grad(self, index: int) -> None:
        """Move parameter `index`'s fresh .grad into the unit (called from its post-accumulate hook)."""
        p = self.params[index]
        grad = p.grad
        if grad is None:
            return
        if self.grad_state in (GradState.REDUCING, GradState.REDUCED):
            # a late gradient in this micro-step: finish the round in flight, open another one
            self.wait_reduce()
            self.reported.clear()
        self._ensure_grad_full()
        self.grad_full.view(index).add_(grad)
        p.grad = None  # the unit holds it now; dropping .grad frees the per-parameter copy
        self.reported.add(index)
        self.received[index] = True
        self.grad_state = GradState.FILLING

    def launch_reduce(self) -> None:
        """Start this round's reduce-scatter (every rank must call it, in the same unit order)."""
        assert self.grad_state is not GradState.REDUCING
        self._ensure_grad_full()  # a rank without gradients takes part with zeros
        full = self.grad_full.tensor
        self._reduce_handle = self.shards.reduce_scatter(self.grad_full.shard(self.shard_index), full)
        self.rounds_launched += 1
        self.grad_state = GradState.REDUCING

    def wait_reduce(self) -> None:
        """Finish the reduction: average over ranks into grad_shard and free the full gradient."""
        if self.grad_state is not GradState.REDUCING:
            return
        self._reduce_handle.wait()
        self._reduce_handle = None
        reduced = self.grad_full.shard(self.shard_index)
        # sum over ranks, then divide: the same arithmetic as stages 0-2
        reduced.div_(self.shards.world)
        self.grad_shard.add_(reduced)
        free_storage(self.grad_full.tensor)
        self.grad_state = GradState.REDUCED

    def start_round(self) -> None:
        """Reset per-micro-step bookkeeping before a backward (grad_shard keeps accumulating)."""
        assert self.grad_state is not GradState.REDUCING
        self.reported.clear()
        self.rounds_launched = 0
        if self.grad_state is not GradState.FILLING:
            self.grad_state = GradState.IDLE

    def zero_grad(self) -> None:
        """Forget gradients after an optimizer step (or a skipped one)."""
        self.wait_reduce()
        self.grad_shard.zero_()
        free_storage(self.grad_full.tensor)
        self.received.zero_()
        self.reported.clear()
        self.rounds_launched = 0
        self.grad_state = GradState.IDLE

    def after_step_gather(self):
        """Persistent units: start gathering the updated shards into the full parameters; returns the handle."""
        assert self.persistent
        return comm.all_gather(self.gathered.tensor, self.param_shard, self.shards.process_group,
                               async_op=True, tag="param")

    def __repr__(self) -> str:
        kind = "persistent" if self.persistent else ("frozen" if not self.trainable else "sharded")
        return (f"FlatUnit({self.index}, {self.module_name!r}, group={self.group_index}, {kind}, "
                f"numel={self.layout.numel}, {self.state.name})")
