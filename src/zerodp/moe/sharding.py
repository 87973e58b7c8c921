"""ZeRO with expert parallelism: `ExpertParallelSharding`, the strategy the engine drives for a model with MoE
layers (`seams.ShardingStrategy`), and `ExpertNorm`, its gradient-norm rule.

The dense parameters are laid out by the configured stage over all N ranks, each ep_size's expert parameters
by the same stage over their expert-data-parallel group (expert_groups.py), except at stage 3: there the
experts are laid out at stage 2 (whole on their ranks, which hold only E/P experts already; gradients and
optimizer state sharded), and stage 3's units leave them out. The strategy drives the parts in a fixed order
and concatenates their units (dense first), so the optimizer steps them as one list. Every part averages over
N (module docstring of expert_groups.py).

Norm, the unsharded single-process model's: ||g||^2 = dense^2 + experts^2.
    stages 1-3   every rank's shards are disjoint pieces of the whole model (a dense shard is 1/N of the
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
from typing import Optional

import torch

from .. import comm
from ..shard.grads.grad_shard import square_norm
from ..shard.seams import ShardedUnit
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
    """Dense and expert parts driven as one strategy (module docstring): at stages 0-2 one `GradReducer` per part;
    at stage 3 the dense part is the stage-3 strategy and the experts' parts are stage-2 `GradReducer`s."""

    replica_index = 0  # MiCS is refused with expert parallelism (expert_groups.check_supported)

    def __init__(self, parts: list, process_group: comm.ProcessGroup, plan: ExpertPlan) -> None:
        self.plan = plan  # its groups are destroyed at close
        self.parts = [p for p in parts if p.units]
        self.units = [u for part in self.parts for u in part.units]
        self.state_group = process_group

    @property
    def frozen_units(self) -> list:
        return [u for part in self.parts for u in part.frozen_units]

    @property
    def reduces_every_micro_step(self) -> bool:
        return any(part.reduces_every_micro_step for part in self.parts)

    def start_micro_step(self, reduce: bool) -> None:
        for part in self.parts:
            part.start_micro_step(reduce)

    def finish_micro_step(self, boundary: bool) -> Optional[torch.Tensor]:
        """Each part's flags (whether a parameter got a gradient on any rank of its group), concatenated."""
        flags = [part.finish_micro_step(boundary) for part in self.parts]
        if not boundary:
            return None
        return torch.cat([torch.ones(len([p for u in part.units for p in u.params]), dtype=torch.bool)
                          if f is None else f.to(torch.bool) for part, f in zip(self.parts, flags)])

    def after_step(self) -> None:
        for part in self.parts:
            part.after_step()

    def end_step(self) -> None:
        for part in self.parts:
            part.end_step()

    def release_kept_units(self) -> None:
        for part in self.parts:
            part.release_kept_units()

    @contextlib.contextmanager
    def all_resident(self, dirty: bool = False):
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.all_resident(dirty))
            yield

    def param_offload(self) -> None:
        return None  # offload_param is refused with expert parallelism

    def take_written_units(self) -> list:
        return [u for part in self.parts for u in part.take_written_units()]

    def prepare_for_compile(self) -> None:
        for part in self.parts:
            part.prepare_for_compile()

    def close(self) -> None:
        for part in self.parts:
            part.close()
        self.plan.close(self.state_group)
