"""Gradient buckets, the communication units of stages 0, 1 and 2: `GradBucket` and `build_buckets`.

A `GradBucket` holds the parameters of one optimizer param group as views into one flat, padded
parameter buffer, and their gradients in one `grads.grad_shard.GradShard` (the gradient life cycle
every stage shares). The strategy (`strategy.GradReducer`) launches a bucket's reduction as soon as
every parameter of it has reported, so it overlaps with the rest of backward.

Stage policy, in one place (`ReducePolicy`):
- stage 0: all-reduce the whole bucket at the accumulation boundary; every rank keeps all of it.
- stage 1: reduce-scatter at the accumulation boundary; the full gradient buffer persists across
  micro-steps (Pos: only optimizer state is sharded).
- stage 2: reduce-scatter after every micro-step, add the 1/N slice into a persistent gradient shard,
  and free the full buffer at once (Pos+g: gradients are sharded too).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager, Optional

import torch

from ... import comm
from ..flat.buffer import FlatBuffer
from ..grads.grad_arithmetic import GradArithmetic, GradCollective
from ..grads.grad_shard import GradShard
from ..flat.whole_tensor_layout import layout_of


@dataclass(frozen=True)
class ReducePolicy:
    """How a stage reduces gradients."""

    shard_grads: bool            # keep only this rank's 1/N of reduced gradients (stage 2)
    shard_optimizer: bool        # the optimizer steps only this rank's shard (stages 1, 2)
    use_all_reduce: bool = False  # DeepSpeed's reduce_scatter=false

    @classmethod
    def for_stage(cls, stage: int, reduce_scatter: bool = True) -> "ReducePolicy":
        if stage not in (0, 1, 2):
            raise ValueError(f"gradient buckets serve stages 0-2, not {stage}")
        return cls(shard_grads=stage == 2, shard_optimizer=stage >= 1, use_all_reduce=not reduce_scatter)

    @property
    def reduces_every_micro_step(self) -> bool:
        """Stage 2 reduces after every micro-step (gradients are sharded); stages 0-1 at the boundary."""
        return self.shard_grads


class GradBucket:
    """Flat parameter buffer and gradient shard of one communication unit (stages 0-2)."""

    # stages 0-2 offload no parameter or gradient (offload_optimizer moves optimizer state only)
    param_offloaded = False
    grad_offloaded = False

    def __init__(self, params: list[torch.nn.Parameter], group_index: int, policy: ReducePolicy,
                 process_group: comm.ProcessGroup, whole_tensors: bool = False,
                 arithmetic: Optional[GradArithmetic] = None, round_views: bool = False) -> None:
        self.params = params
        self.group_index = group_index
        self.policy = policy
        self.process_group = process_group
        world = comm.get_world_size(process_group)
        num_shards = world if policy.shard_optimizer else 1
        self.layout = layout_of([p.shape for p in params], num_shards, whole_tensors)
        self.shard_index = comm.get_rank(process_group) if policy.shard_optimizer else 0
        first = params[0]
        self.param_buffer = FlatBuffer(self.layout, first.dtype, first.device)
        self.param_buffer.copy_from(params)
        for p, view in zip(params, self.param_buffer.views()):
            p.data = view  # the module now computes on the flat buffer; no copy at step time
        # Stages 0-1 keep the full gradient buffer across micro-steps; stage 2 only while reducing (`round_views`:
        # autograd adds into views of it, see [Note: gradients as buffer views]).
        # the stage's collective is passed down with the arithmetic: the shard calls comm, not back into the bucket
        collective = GradCollective(process_group, scatter=policy.shard_optimizer,
                                    use_all_reduce=policy.use_all_reduce)
        self.grads = GradShard(params, self.layout, self.shard_index, arithmetic or GradArithmetic(world),
                               collective, keep_full=not policy.shard_grads, name=f"bucket of group {group_index}",
                               round_views=round_views)

    @property
    def param_shard(self) -> torch.Tensor:
        """This rank's slice of the parameters (the whole buffer at stage 0)."""
        return self.param_buffer.shard(self.shard_index)

    @property
    def grad_shard(self) -> torch.Tensor:
        """This rank's reduced, rank-averaged gradients (the whole buffer at stage 0)."""
        return self.grads.shard

    def resident(self, dirty: bool = False) -> ContextManager[None]:
        """The shards are always in memory."""
        return contextlib.nullcontext()

    def grad_resident(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def grad_square_norm(self) -> torch.Tensor:
        """float64 square of the gradient shard's 2-norm."""
        return self.grads.shard_square_norm()

    def param_bytes(self) -> int:
        """Bytes of parameter storage this bucket holds on this rank."""
        return self.param_buffer.nbytes

    def grad_bytes(self) -> int:
        """Bytes of gradient storage this bucket holds right now (full buffer and/or shard)."""
        return self.grads.nbytes

    def zero_grad(self) -> None:
        """Forget gradients after an optimizer step (or a skipped one)."""
        self.grads.zero_grad()

    def gather_params(self, message_numel: int) -> comm.Handle:
        """Launch the all-gather of the updated shards into the full parameter buffer (stages 1-2).

        Messages are at most `message_numel` elements (DeepSpeed's allgather_bucket_size).
        """
        return comm.all_gather(self.param_buffer.tensor, self.param_shard, self.process_group, async_op=True,
                               tag="param", max_message_numel=message_numel)


# A whole-tensor bucket's fair share per rank, in units of its largest tensor (see build_buckets).
BALANCE_FACTOR = 4


def build_buckets(groups: list[list[torch.nn.Parameter]], policy: ReducePolicy,
                  process_group: comm.ProcessGroup, bucket_numel: int,
                  whole: Optional[list[bool]] = None, arithmetic: Optional[GradArithmetic] = None, *,
                  round_views: bool = False) -> list[GradBucket]:
    """Split each optimizer group's parameters into buckets of at most `bucket_numel` elements.

    Parameters are walked in reverse model order, which approximates the order in which backward
    produces their gradients, so early buckets complete (and start reducing) early. A bucket never
    mixes param groups (its shard is one tensor of one group), dtypes or reduction dtypes (torch_autocast). `whole[g]`: group g's
    buckets give each rank whole tensors (flat/whole_tensor_layout.py); see [Note: whole-tensor buckets].
    `round_views`: stage 2's per-round gradient buffers are handed to autograd as views (placement.py).
    """
    whole = whole or [False] * len(groups)
    world = comm.get_world_size(process_group) if policy.shard_optimizer else 1
    items = [(gi, p) for gi, g in enumerate(groups) for p in g]
    position = {id(p): k for k, (_, p) in enumerate(items)}
    items.sort(key=lambda it: -position[id(it[1])])
    buckets: list[GradBucket] = []
    open_: dict[tuple, tuple[list, int]] = {}
    for gi, p in items:
        key = (gi, p.dtype, p.device, arithmetic.comm_dtype_of(p) if arithmetic is not None else None)
        params, numel = open_.get(key, ([], 0))
        # [Note: whole-tensor buckets] Each bucket's whole tensors are balanced over the ranks on their
        # own (its shards are equal, so the fullest rank sets the padding for all). A bucket of a few
        # tensors balances badly (base GPT, 8 ranks, 5M-element buckets: 40% padding), so a whole-tensor
        # bucket only closes once each rank's fair share is at least BALANCE_FACTOR times its largest
        # tensor: then greedy balance pads little (Muon on the base GPT's blocks: 0% at 2-8 ranks), at
        # the price of larger buckets (stage 2's temporary full-gradient buffer is one bucket).
        balanced = not whole[gi] or numel >= BALANCE_FACTOR * world * max((q.numel() for q in params), default=0)
        if params and numel + p.numel() > bucket_numel and balanced:
            buckets.append(GradBucket(params, gi, policy, process_group, whole[gi], arithmetic, round_views))
            params, numel = [], 0
        open_[key] = (params + [p], numel + p.numel())
    for (gi, *_), (params, _) in open_.items():
        if params:
            buckets.append(GradBucket(params, gi, policy, process_group, whole[gi], arithmetic, round_views))
    return buckets

