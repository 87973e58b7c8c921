"""Gradient buckets and their asynchronous reduction, for stages 0, 1 and 2.

A `GradBucket` is one communication unit: the parameters of one optimizer param group, stored as
views into one flat, padded parameter buffer, with a matching flat gradient buffer. As each
parameter's gradient is produced in backward (a post-accumulate-grad hook), it is added into the
bucket and the parameter's own `.grad` is dropped. When every parameter of a bucket has reported,
the bucket's reduction is launched; it overlaps with the rest of backward.

Stage policy, in one place (`ReducePolicy`):
- stage 0: all-reduce the whole bucket at the accumulation boundary; every rank keeps all of it.
- stage 1: reduce-scatter at the accumulation boundary; the full gradient buffer persists across
  micro-steps (Pos: only optimizer state is sharded).
- stage 2: reduce-scatter after every micro-step, add the 1/N slice into a persistent gradient shard,
  and free the full buffer at once (Pos+g: gradients are sharded too).

[Note: collective order] Buckets are launched strictly in index order (bucket i only after 0..i-1),
as DDP does. Readiness may differ between ranks; the order of collectives then still matches on
every rank, which gloo and NCCL require (a mismatch hangs or silently mixes tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Optional

import torch
import torch.distributed as dist

from .. import comm
from ..flat.buffer import FlatBuffer, alloc_storage, free_storage
from ..flat.layout import FlatLayout


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

    def reduces_every_micro_step(self) -> bool:
        return self.shard_grads


class BucketState(Enum):
    IDLE = auto()       # no gradient this round
    FILLING = auto()    # some parameters reported
    REDUCING = auto()   # reduction launched, not yet waited on
    REDUCED = auto()    # this round's reduction finished


class GradBucket:
    """Flat parameter and gradient buffers of one communication unit (stages 0-2)."""

    def __init__(self, params: list[torch.nn.Parameter], group_index: int, policy: ReducePolicy,
                 process_group: comm.ProcessGroup) -> None:
        self.params = params
        self.group_index = group_index
        self.policy = policy
        self.process_group = process_group
        self.world = comm.get_world_size(process_group)
        self.rank = comm.get_rank(process_group)
        num_shards = self.world if policy.shard_optimizer else 1
        self.layout = FlatLayout.of([p.shape for p in params], num_shards)
        self.shard_index = self.rank if policy.shard_optimizer else 0
        first = params[0]
        self.param_buffer = FlatBuffer(self.layout, first.dtype, first.device)
        self.param_buffer.copy_from(params)
        for p, view in zip(params, self.param_buffer.views()):
            p.data = view  # the module now computes on the flat buffer; no copy at step time
        self.grad_buffer = FlatBuffer(self.layout, first.dtype, first.device)
        if policy.shard_grads:
            free_storage(self.grad_buffer.tensor)  # allocated per round, see _ensure_grad_buffer
            self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=first.dtype, device=first.device)
        else:
            self.grad_shard = self.grad_buffer.shard(self.shard_index)
        self.state = BucketState.IDLE
        self.reported: set[int] = set()
        self.received = torch.zeros(len(params), dtype=torch.bool)
        self._stash: Optional[torch.Tensor] = None
        self._handle: Optional[comm.Handle] = None

    @property
    def param_shard(self) -> torch.Tensor:
        """This rank's slice of the parameters (the whole buffer at stage 0)."""
        return self.param_buffer.shard(self.shard_index)

    def param_bytes(self) -> int:
        """Bytes of parameter storage this bucket holds on this rank."""
        return self.param_buffer.nbytes

    def grad_bytes(self) -> int:
        """Bytes of gradient storage this bucket holds right now (full buffer and/or shard)."""
        shard = self.grad_shard.numel() * self.grad_shard.element_size() if self.policy.shard_grads else 0
        return self.grad_buffer.nbytes + shard

    def _ensure_grad_buffer(self) -> None:
        if self.policy.shard_grads and self.grad_buffer.nbytes == 0:
            alloc_storage(self.grad_buffer.tensor, self.layout.padded_numel)
            self.grad_buffer.tensor.zero_()

    def add_grad(self, index: int) -> None:
        """Move parameter `index`'s fresh gradient into the bucket (called from its hook)."""
        p = self.params[index]
        if p.grad is None:
            return
        if self.state in (BucketState.REDUCING, BucketState.REDUCED):
            # A gradient after this round's reduction (e.g. a weight used again in a re-entrant
            # checkpoint's recomputation): finish the round, then open another one.
            self.wait()
            if not self.policy.shard_grads:
                # The persistent buffer holds this round's reduced sums: keep our averaged shard aside
                # and start the next round from zeros so nothing is reduced twice.
                self._stash = self.grad_shard.clone()
                self.grad_buffer.tensor.zero_()
            self.state = BucketState.IDLE
            self.reported.clear()
        self._ensure_grad_buffer()
        self.grad_buffer.view(index).add_(p.grad)
        p.grad = None  # the bucket holds it now; dropping .grad is what frees the per-param copy
        self.reported.add(index)
        self.received[index] = True
        self.state = BucketState.FILLING

    @property
    def complete(self) -> bool:
        return len(self.reported) == len(self.params)

    def launch(self, async_op: bool) -> None:
        """Start this round's reduction (every rank must call it, in bucket order)."""
        self._ensure_grad_buffer()
        full = self.grad_buffer.tensor
        if not self.policy.shard_optimizer:
            self._handle = comm.all_reduce(full, self.process_group, async_op=async_op, tag="grad")
        else:
            self._handle = comm.reduce_scatter(self.grad_buffer.shard(self.rank), full, self.process_group,
                                               async_op=async_op, use_all_reduce=self.policy.use_all_reduce,
                                               tag="grad")
        self.state = BucketState.REDUCING

    def wait(self) -> None:
        """Finish the reduction: average over ranks into the gradient shard, free what stage 2 frees."""
        if self.state is not BucketState.REDUCING:
            return
        self._handle.wait()
        self._handle = None
        reduced = self.grad_buffer.shard(self.shard_index)
        # Sum across ranks, then divide: exact for two ranks in fp32, and what a single process
        # computes on the global batch up to summation order.
        reduced.div_(self.world)
        if self.policy.shard_grads:
            self.grad_shard.add_(reduced)
            free_storage(self.grad_buffer.tensor)
        elif self._stash is not None:
            reduced.add_(self._stash)
            self._stash = None
        self.state = BucketState.REDUCED

    def zero_grad(self) -> None:
        """Forget gradients after an optimizer step (or a skipped one)."""
        if self.policy.shard_grads:
            self.grad_shard.zero_()
            free_storage(self.grad_buffer.tensor)
        else:
            self.grad_buffer.tensor.zero_()
        self.received.zero_()
        self.reported.clear()
        self._stash = None
        self.state = BucketState.IDLE

    def start_micro_step(self) -> None:
        """Reset per-round bookkeeping before a backward (stage 0/1 keep accumulating in place)."""
        self.reported.clear()
        if self.state is not BucketState.FILLING:
            self.state = BucketState.IDLE


class GradReducer:
    """The stage 0-2 sharding strategy: owns the buckets' hooks, launches reductions in bucket order
    (see [Note: collective order]) and re-assembles parameters after the step.

    The engine drives any strategy through the same members: `units`, `frozen_units`,
    `reduces_every_micro_step`, `start_micro_step`, `flush`, `after_step` and `attach_optimizer`.
    """

    frozen_units: tuple = ()  # stages 0-2 keep frozen parameters whole, outside any unit

    def __init__(self, buckets: list[GradBucket], process_group: comm.ProcessGroup, overlap: bool,
                 policy: ReducePolicy, allgather_numel: int) -> None:
        self.buckets = buckets
        self.units = buckets
        self.process_group = process_group
        self.overlap = overlap
        self.policy = policy
        self.reduces_every_micro_step = policy.reduces_every_micro_step()
        self.allgather_numel = allgather_numel
        self.reducing_this_micro_step = False
        self._next_launch = 0
        self._hooks = []
        for bucket_index, bucket in enumerate(buckets):
            for index, p in enumerate(bucket.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(bucket_index, index)))

    def _make_hook(self, bucket_index: int, index: int):
        def hook(param: torch.Tensor) -> None:
            self.buckets[bucket_index].add_grad(index)
            if self.reducing_this_micro_step:
                self._launch_ready()
        return hook

    def start_micro_step(self, reduce: bool) -> None:
        """Prepare for one backward; `reduce` says whether gradients are reduced after it."""
        self.reducing_this_micro_step = reduce
        self._next_launch = 0
        for b in self.buckets:
            b.start_micro_step()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].complete:
            bucket = self.buckets[self._next_launch]
            bucket.launch(async_op=self.overlap)
            if not self.overlap:
                bucket.wait()
            self._next_launch += 1

    def flush(self, boundary: bool) -> Optional[torch.Tensor]:
        """After backward: launch what is left (in order), wait, and run late rounds.

        At an accumulation boundary, returns per-parameter flags (concatenated over buckets) saying
        whether the parameter got a gradient on any rank during the step; None otherwise.
        """
        if not self.reducing_this_micro_step:
            return None
        while self._next_launch < len(self.buckets):
            self.buckets[self._next_launch].launch(async_op=self.overlap)
            self._next_launch += 1
        for b in self.buckets:
            b.wait()
        # One small control collective: which buckets got late gradients on some rank (they need
        # another round everywhere), and at the boundary which parameters got any gradient at all.
        late = [1.0 if b.state is BucketState.FILLING else 0.0 for b in self.buckets]
        parts = [torch.tensor(late)]
        if boundary:
            parts += [b.received.float() for b in self.buckets]
        # collectives need the backend's device (NCCL: CUDA); the flags are tiny
        device = self.buckets[0].param_buffer.tensor.device if self.buckets else None
        flags = torch.cat(parts).to(device)
        comm.all_reduce(flags, self.process_group, op=dist.ReduceOp.MAX, tag="control")
        for b, flag in zip(self.buckets, flags[:len(self.buckets)].tolist()):
            if flag > 0:
                b.launch(async_op=False)
                b.wait()
        return (flags[len(self.buckets):] > 0).cpu() if boundary else None

    def after_step(self) -> None:
        """All-gather every bucket's updated shards into the full parameters (stages 1-2)."""
        if not self.policy.shard_optimizer:
            return  # stage 0: every rank stepped the full parameters already
        handles = [gather_bucket_params(b, self.allgather_numel) for b in self.buckets]
        for handle in handles:
            handle.wait()

    def attach_optimizer(self, optimizer) -> None:
        """Nothing to do: stage 0-2 parameters are plain tensors that the masters update directly."""

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def build_buckets(groups: list[list[torch.nn.Parameter]], policy: ReducePolicy,
                  process_group: comm.ProcessGroup, bucket_numel: int) -> list[GradBucket]:
    """Split each optimizer group's parameters into buckets of at most `bucket_numel` elements.

    Parameters are walked in reverse model order, which approximates the order in which backward
    produces their gradients, so early buckets complete (and start reducing) early. A bucket never
    mixes param groups (its shard is one tensor of one group) or dtypes.
    """
    items = [(gi, p) for gi, g in enumerate(groups) for p in g]
    position = {id(p): k for k, (_, p) in enumerate(items)}
    items.sort(key=lambda it: -position[id(it[1])])
    buckets: list[GradBucket] = []
    open_: dict[tuple, tuple[list, int]] = {}
    for gi, p in items:
        key = (gi, p.dtype, p.device)
        params, numel = open_.get(key, ([], 0))
        if params and numel + p.numel() > bucket_numel:
            buckets.append(GradBucket(params, gi, policy, process_group))
            params, numel = [], 0
        open_[key] = (params + [p], numel + p.numel())
    for (gi, _, _), (params, _) in open_.items():
        if params:
            buckets.append(GradBucket(params, gi, policy, process_group))
    return buckets


def gather_bucket_params(bucket: GradBucket, message_numel: int) -> comm.Handle:
    """Launch the all-gather of a bucket's updated shards into its full parameter buffer.

    Messages are at most `message_numel` elements (DeepSpeed's allgather_bucket_size).
    """
    return comm.all_gather(bucket.param_buffer.tensor, bucket.param_shard, bucket.process_group, async_op=True,
                           tag="param", max_message_numel=message_numel)
