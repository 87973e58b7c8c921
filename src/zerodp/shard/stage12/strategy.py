"""The stage 0-2 sharding strategy: `GradReducer`, what the engine drives (`seams.ShardingStrategy`).

It hooks every bucket's gradients (stages 0-1: one trigger per bucket, grads/bucket_intake.py), reduces
buckets through one `grads.reduce_queue.ReduceQueue` in bucket order (see [Note: collective order]
there) and, after the optimizer step, all-gathers the updated shards back into the full parameters
(stages 1-2; stage 0 stepped them whole).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

import torch

from ... import comm
from ..grads.bucket_intake import BucketIntake, Mode
from ..grads.param_hook import STRAY, param_hook
from ..grads.reduce_queue import MAX_INFLIGHT, ReduceQueue
from .buckets import GradBucket, ReducePolicy


class GradReducer:
    """Stages 0-2: buckets reduced in order as they complete, parameters re-assembled after the step."""

    frozen_units: tuple = ()  # stages 0-2 keep frozen parameters whole, outside any unit

    def __init__(self, buckets: list[GradBucket], process_group: comm.ProcessGroup, overlap: bool,
                 policy: ReducePolicy, allgather_numel: int) -> None:
        self.buckets = buckets
        self.units = buckets
        self.process_group = process_group
        self.state_group = process_group  # the optimizer's shards are split over every rank
        self.replica_index = 0
        self.policy = policy
        self.allgather_numel = allgather_numel
        self.reducing_this_micro_step = False
        self.in_backward = False  # between start_micro_step and finish_micro_step: gradients are expected
        # collectives need the backend's device (NCCL: CUDA); the control flags are tiny
        device = buckets[0].param_buffer.tensor.device if buckets else torch.device("cpu")
        # overlap_comm=false: each reduction completes before backward goes on. Stages 1-2 bound the reductions in
        # flight (each holds buffers until waited on: see MAX_INFLIGHT); stage 0 all-reduces in place, into the
        # buffer it keeps anyway, so waiting early would free nothing and it waits at the end, as DDP does.
        inflight = MAX_INFLIGHT if policy.shard_optimizer else None
        self.queue = ReduceQueue(process_group, device, async_op=overlap, max_inflight=inflight if overlap else 0,
                                 reduce_all=True)
        # Stages 0-1 (the gradient buffer persists, in the parameters' dtype): one hook per bucket once its trigger is
        # learned ([Note: arrivals read from version counters] in grads/bucket_intake.py); else one per parameter.
        self.intakes = [BucketIntake(b.grads) if b.grads.keep_full and b.grads.grad_views else None for b in buckets]
        self._hooks: list[list] = [[] for _ in buckets]
        for k in range(len(buckets)):
            self._install_hooks(k)

    @property
    def reduces_every_micro_step(self) -> bool:
        return self.policy.reduces_every_micro_step

    def _install_hooks(self, k: int) -> None:
        """(Re-)register bucket k's gradient hooks: its trigger's, or one per parameter (bucket_intake.Mode)."""
        for h in self._hooks[k]:
            h.remove()
        bucket, intake = self.buckets[k], self.intakes[k]
        if intake is not None and intake.mode is Mode.TRIGGER:
            hook = intake.make_hook(self, self._on_bucket_complete, self._discard_strays)
            self._hooks[k] = [bucket.params[intake.trigger].register_post_accumulate_grad_hook(hook)]
            return
        # runs once per parameter per backward ([Note: hook cost] in grads/param_hook.py), refusing gradients
        # outside engine.backward (self.in_backward)
        g = bucket.grads
        self._hooks[k] = [p.register_post_accumulate_grad_hook(param_hook(g, i, self, self._on_bucket_complete,
                                                                          self._discard_strays))
                          for i, p in enumerate(bucket.params)]

    def _discard_strays(self) -> int:
        """Drop every .grad a stray backward left on the stage 0-1 buckets' parameters; how many there were."""
        strays = [p for intake in self.intakes if intake is not None for p in intake.strays()]
        for p in strays:
            p.grad = None
        return len(strays)

    def _on_bucket_complete(self) -> None:
        """A bucket got its last gradient: launch, in order, what is ready (only a completion can free one)."""
        if self.reducing_this_micro_step:
            self.queue.launch_ready()

    def start_micro_step(self, reduce: bool) -> None:
        """Before one backward; `reduce` says whether gradients are reduced after it."""
        if self.in_backward:
            # The last engine.backward raised before its end (finish_micro_step never ran): what its gradients left
            # (arrivals in the aliases, late .grads) is taken in now, as the hooks per parameter did while it ran,
            # before the fresh .grads are mistaken for a stray backward's
            self._settle_intakes()
            for bucket in self.buckets:  # its launched rounds: finished, their sums kept (not "still reducing")
                bucket.grads.after_raised_backward()
        strays = self._discard_strays()  # a stray backward that reached no trigger ([Note: arrivals read from ...])
        if strays:  # a .grad set by hand looks the same (stages 2-3 add one in; here it cannot be told apart)
            raise RuntimeError(STRAY + f" (found at the next engine.backward on {strays} parameter(s); nothing of it "
                               f"was added). A .grad set by hand before engine.backward (say pre-allocated zeros) is "
                               f"refused the same way at stages 0-1: leave .grad None, the engine keeps the gradients")
        self.reducing_this_micro_step = reduce
        self.in_backward = True
        self.queue.start([b.grads for b in self.buckets])
        for intake in self.intakes:
            if intake is not None:
                intake.begin()

    def _settle_intakes(self) -> None:
        """The end of a backward for the stage 0-1 buckets' intakes: take in what their triggers did not see."""
        for k, intake in enumerate(self.intakes):
            if intake is not None and intake.settle():
                self._install_hooks(k)  # the trigger moved

    def finish_micro_step(self, boundary: bool) -> Optional[torch.Tensor]:
        """After backward: finish every reduction (if this micro-step reduces).

        At an accumulation boundary, returns per-parameter flags (concatenated over buckets) saying
        whether the parameter got a gradient on any rank during the step; None otherwise.
        """
        self.in_backward = False
        self._settle_intakes()
        for bucket in self.buckets:  # [Note: gradients as buffer views] in grads/grad_shard.py
            bucket.grads.detach_grad_views()
        if not self.reducing_this_micro_step:
            return None
        return self.queue.finish(boundary, [b.grads for b in self.buckets])

    def after_step(self) -> None:
        """All-gather every bucket's updated shards into the full parameters (stages 1-2)."""
        if not self.policy.shard_optimizer:
            return  # stage 0: every rank stepped the full parameters already
        handles = [b.gather_params(self.allgather_numel) for b in self.buckets]
        for handle in handles:
            handle.wait()

    def end_step(self) -> None:
        """Nothing: stages 0-2 keep no per-step plan."""

    def release_kept_units(self) -> None:
        """Nothing: stages 0-2 keep every parameter whole, nothing is kept gathered."""

    def all_resident(self, dirty: bool = False) -> ContextManager[None]:
        """Stages 0-2 never offload parameters: always resident."""
        return contextlib.nullcontext()

    def param_offload(self) -> None:
        """None: offload_param is stage 3's (stages 0-2 offload only optimizer state)."""
        return None

    def take_written_units(self) -> list:
        """None: stage 0-2 shards are only written by the optimizer step (and checkpoint loads)."""
        return []

    def prepare_for_compile(self) -> None:
        """Nothing: stages 0-2 hook only gradients (autograd hooks, outside the compiled forward)."""

    def close(self) -> None:
        """Remove the gradient hooks construction installed (idempotent)."""
        for hooks in self._hooks:
            for h in hooks:
                h.remove()
            hooks.clear()
