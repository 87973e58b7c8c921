"""The seams between zerodp's parts, written down as `typing.Protocol`s that the code obeys.

    engine ──drives──> ShardingStrategy (stage12.strategy.GradReducer,
       │                                 stage3.strategy.Stage3Sharding)
       │                   └── units: ShardedUnit (stage12.buckets.GradBucket, stage3.flat_unit.FlatUnit)
       └──steps──> optim.optimizer.ShardedOptimizer (over the strategy's units)
    checkpoint ──reads──> CheckpointEngine: the engine's public members, its strategy's units and
                          its optimizer's CheckpointOptimizer members, nothing private

Every implementation is checked against its Protocol on every change (tests/unit/shard/test_seams.py: each
member present, each method's parameters the Protocol's), so a seam cannot drift silently.

Calls run one way: the engine calls the strategy and the optimizer; neither calls the other or
back into the engine. One optimizer step, as the engine runs it:
    strategy.start_micro_step(reduce) ; loss.backward() ; received = strategy.finish_micro_step(boundary)
    at a boundary: optimizer.step(received) ; strategy.after_step() (if it stepped) ; unit.zero_grad()
                   ; strategy.end_step()

Residency (offload_param, stage 3) is the unit's own business ([Note: a unit owns its residency] in
stage3/flat_unit.py): a unit's shards may have storage only inside `unit.resident(dirty=...)` /
`unit.grad_resident()`, so every reader of `param_shard` / `grad_shard` holds them there; where nothing
is offloaded those blocks are empty. Nobody above the units and the strategy touches an offload store.
"""

from __future__ import annotations

from typing import Any, ContextManager, NamedTuple, Optional, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from .flat.layout import FlatLayout
from .grads.grad_destination import GradDestination


@runtime_checkable
class GradLifeCycle(Protocol):
    """What is seen of a unit's gradient life cycle (grads/grad_shard.py) from outside its stage: where its
    reduced shard's deliveries also go, chosen once when the engine is composed (engine/grad_path.py)."""

    def deliver_to(self, destination: GradDestination) -> None: ...


@runtime_checkable
class ShardedUnit(Protocol):
    """One flat buffer of parameters and this rank's shard of it: what the optimizer steps and
    checkpoints save (a stage 0-2 bucket or a stage-3 flat unit)."""

    params: list[nn.Parameter]  # in layout order
    group_index: int            # the user's optimizer group (-1: frozen)
    layout: FlatLayout
    shard_index: int            # which of layout.num_shards slices this rank holds
    grads: GradLifeCycle        # its gradient life cycle (ZeRO-Offload: delivers into host staging, grad_path.py)

    # this rank's parameter slice (the model computes on it); storage only inside resident() if param_offloaded
    @property
    def param_shard(self) -> torch.Tensor: ...

    # this rank's reduced, rank-averaged gradient slice; storage only inside grad_resident() if grad_offloaded
    @property
    def grad_shard(self) -> torch.Tensor: ...

    @property
    def param_offloaded(self) -> bool: ...  # param_shard lives in an offload store between uses

    @property
    def grad_offloaded(self) -> bool: ...   # grad_shard too (stage 3, fp32, offload_param nvme)

    def resident(self, dirty: bool = False) -> ContextManager[None]: ...  # param_shard in memory (dirty: written)

    def grad_resident(self) -> ContextManager[None]: ...  # grad_shard in memory for reading

    def grad_square_norm(self) -> torch.Tensor: ...  # float64 |grad_shard|^2, without reading an offloaded shard

    def zero_grad(self) -> None: ...

    def param_bytes(self) -> int: ...

    def grad_bytes(self) -> int: ...


class ParamOffload(NamedTuple):
    """offload_param (stage 3): this rank's offloaded shards as they are now (what memory_report reads)."""

    limit_numel: int                # parameter elements kept in memory at most (max_in_cpu, or the working set)
    disk_bytes: int                 # the parameter shards' files
    grad_disk_bytes: Optional[int]  # fp32 nvme: the gradient shards' files; None: gradient shards stay in memory


@runtime_checkable
class ShardingStrategy(Protocol):
    """What the engine drives, at every stage (stages differ by policy inside the strategy)."""

    units: Sequence[ShardedUnit]         # trainable units, in the order the optimizer steps them
    frozen_units: Sequence[ShardedUnit]  # sharded frozen parameters (stage 3); never stepped
    state_group: Any                     # the ranks the units' shards split over: the engine's, or a MiCS block
    replica_index: int                   # MiCS: this rank's block (0 writes checkpoint shards); else 0

    @property
    def reduces_every_micro_step(self) -> bool: ...  # else only at the accumulation boundary

    def start_micro_step(self, reduce: bool) -> None: ...

    def finish_micro_step(self, boundary: bool) -> Optional[torch.Tensor]: ...

    def after_step(self) -> None: ...  # re-assemble full parameters from the updated shards

    def end_step(self) -> None: ...  # an optimizer step ended, taken or skipped (offload: plan the next's reads)
    def release_kept_units(self) -> None: ...  # drop units kept gathered between evaluation forwards

    def take_written_units(self) -> list[ShardedUnit]: ...  # shards written outside the optimizer

    def all_resident(self, dirty: bool = False) -> ContextManager[None]: ...  # every unit's param_shard in memory

    def param_offload(self) -> Optional[ParamOffload]: ...  # None: no parameter shard leaves memory

    def prepare_for_compile(self) -> None: ...  # its module hooks must run eagerly under torch.compile

    def close(self) -> None: ...  # remove hooks, registry entries, communicators and offload files it created


@runtime_checkable
class CheckpointOptimizer(Protocol):
    """What checkpoints may read and set of the sharded optimizer (one flat master per unit)."""

    masters: list[torch.Tensor]       # fp32 master shards, one per strategy unit, same order
    optimizer: Any                    # the inner optimizer (its class and LARC settings are saved)
    group_indices: list[int]          # the user's group index of each inner group
    param_groups: list[dict]          # the inner groups (hyper-parameters)

    def state_of(self, index: int) -> dict: ...

    def state_spec_of(self, index: int) -> tuple[dict[str, torch.dtype], dict]: ...  # state_of's keys, no read

    def load_state_of(self, index: int, state: dict) -> None: ...

    # whole-tensor units (flat/whole_tensor_layout.py): state per owned parameter, by layout position
    def tensor_states_of(self, index: int) -> dict[int, dict]: ...

    def load_tensor_states_of(self, index: int, states: dict[int, dict]) -> None: ...

    def scalar_state_device(self, index: int) -> torch.device: ...

    # each parameter's own step count by id(parameter) (optim/step_counts.py); None on load: not saved
    def param_steps(self) -> dict[int, int]: ...

    def load_param_steps(self, saved: Optional[dict[int, int]]) -> None: ...

    def load_master_from_shard(self, index: int) -> None: ...


@runtime_checkable
class CheckpointEngine(Protocol):
    """What checkpoints read and set of a live engine."""

    module: nn.Module
    config: Any
    process_group: Any
    rank: int
    world_size: int
    stage: int
    global_step: int
    micro_step: int
    skipped_steps: int
    gradient_accumulation_steps: int
    scaler: Any
    sharding: ShardingStrategy
    optimizer: CheckpointOptimizer
    placement: Any  # placement.Placement: where masters live and collectives run (compute.device)

    @property
    def lr_scheduler(self) -> Any: ...  # the schedule saved beside the shards, or None

    @property
    def units(self) -> Sequence[ShardedUnit]: ...

    @property
    def at_step_boundary(self) -> bool: ...  # no gradient accumulated since the last optimizer step
