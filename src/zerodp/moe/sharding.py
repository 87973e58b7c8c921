"""ZeRO with expert parallelism: `ExpertParallelSharding`, the strategy the engine drives for a model with MoE
layers (`seams.ShardingStrategy`), and `ExpertNorm`, its gradient-norm rule.

The dense parameters are laid out by the configured stage over all N ranks, each ep_size's expert parameters
by the same stage over their expert-data-parallel group (expert_groups.py); the strategy drives the parts in a
fixed order and concatenates their units (dense first), so the optimizer steps them as one list. Every part
averages over N (module docstring of expert_groups.py).

Norm, the unsharded single-process model's: ||g||^2 = dense^2 + experts^2.
    stages 1-2   every rank's shards are disjoint pieces of the whole model (a dense shard is 1/N of the
                 dense parameters; an expert shard 1/(N/P) of its ep rank's experts, and the expert-data-
                 parallel groups hold disjoint experts), so one all-reduce over the N ranks sums them
    stage 0      every rank holds all dense gradients and its own experts' whole: the expert square is
                 summed over the expert-parallel group (the P ranks together hold every expert once)

[Note: expert reductions wait for backward] Backward runs the all-to-alls of every MoE layer (expert-parallel
group) between the gradient hooks. Which expert buckets are complete before a layer's dispatch all-to-all
depends on where this rank's tokens went, so it differs between ranks. A reduction that blocks (stages 1-2
bound the reductions in flight) inside a hook then deadlocks across groups: rank 0 waits in the expert-data-
parallel group for rank 2, which waits in the all-to-all for rank 3, which waits for rank 1, which waits in
the all-to-all for rank 0 (seen on 4 gloo ranks). So the expert part launches nothing during backward: its
reductions start at the end of backward, in bucket order. The dense part keeps its overlap: a dense
parameter gets its gradient at the same point of every rank's backward.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

import torch

from .. import comm
from ..grads.grad_shard import square_norm
from ..seams import ShardedUnit
from ..stage12.strategy import GradReducer
from .expert_groups import ExpertPlan


class ExpertNorm:
    """The norm and overflow rules of the module docstring (the optimizer's `model_parallel` norm seam)."""

    def __init__(self, expert_units: dict[int, int], plan: ExpertPlan) -> None:
        self.expert_units = expert_units  # id(unit) -> ep_size of its experts
        self.sizes = sorted(plan.groups)
        self.groups = plan.groups

    def square_norms(self, units: list[ShardedUnit], grads: list[torch.Tensor]) -> torch.Tensor:
        """float64 [dense, experts of each ep_size] squares of this rank's gradient shards."""
        sq = torch.zeros(1 + len(self.sizes), dtype=torch.float64, device=grads[0].device if grads else None)
        for unit, g in zip(units, grads):
            slot = 0 if id(unit) not in self.expert_units else 1 + self.sizes.index(self.expert_units[id(unit)])
            sq[slot] += unit.grad_square_norm() if g is unit.grad_shard else square_norm(g)
        return sq

    def global_norm_squared(self, sq: torch.Tensor, data_parallel: comm.ProcessGroup, sharded: bool) -> float:
        """||g||^2 of the single-process model from this rank's squares (collectives; module docstring)."""
        if sharded:
            comm.all_reduce(sq, data_parallel, tag="norm")
        else:
            for k, size in enumerate(self.sizes):
                part = sq[1 + k:2 + k]
                comm.all_reduce(part, self.groups[size].expert_parallel, tag="norm")
        return float(sq.sum())  # note: a host read, as the tensor-parallel rule's

    def any_overflow(self, overflow: bool) -> bool:
        """The overflow vote already ran over all N ranks."""
        return overflow


class ExpertParallelSharding:
    """Stages 0-2 over dense and expert parameters: one `GradReducer` per part (module docstring)."""

    frozen_units: tuple = ()
    replica_index = 0

    def __init__(self, parts: list[GradReducer], process_group: comm.ProcessGroup, plan: ExpertPlan) -> None:
        self.plan = plan  # its groups are destroyed at close
        self.parts = [p for p in parts if p.units]
        self.units = [u for part in self.parts for u in part.units]
        self.state_group = process_group

    @property
    def reduces_every_micro_step(self) -> bool:
        return self.parts[0].reduces_every_micro_step

    def start_micro_step(self, reduce: bool) -> None:
        for part in self.parts:
            part.start_micro_step(reduce)

    def finish_micro_step(self, boundary: bool) -> Optional[torch.Tensor]:
        """Each part's flags (whether a parameter got a gradient on any rank of its group), concatenated."""
        flags = [part.finish_micro_step(boundary) for part in self.parts]
        if any(f is None for f in flags):
            return None
        return torch.cat([f.to(torch.bool) for f in flags])

    def after_step(self) -> None:
        for part in self.parts:
            part.after_step()

    def end_step(self) -> None:
        for part in self.parts:
            part.end_step()

    def release_kept_units(self) -> None:
        """Nothing: stages 0-2 keep every parameter whole."""

    def all_resident(self, dirty: bool = False) -> ContextManager[None]:
        return contextlib.nullcontext()

    def param_offload(self) -> None:
        return None

    def take_written_units(self) -> list:
        return []

    def prepare_for_compile(self) -> None:
        """Nothing: stages 0-2 hook only gradients."""

    def close(self) -> None:
        for part in self.parts:
            part.close()
        self.plan.close(self.state_group)
