"""Module units: gather before a unit's forward and backward, release after them (`ModuleUnit`).

A `ModuleUnit` is a module (a transformer block, or the root) whose forward needs a set of flat
units: its own (one per optimizer group, plus frozen) and any it borrows (see
[Note: external parameters]). Its hooks drive the unit through one training step:

    forward pre-hook   acquire (gather, or wait for the prefetch), prefetch what runs next,
                       and watch the inputs' gradients (a multi-grad hook, "all" mode)
    forward post-hook  release (the storage is freed), and hook the outputs' gradients
    outputs node hook  the unit's backward is about to run: acquire again (pre-backward)
    inputs grad hook   the backward of that call is done: release (post-backward)

Its training state is one enum with asserted transitions (`TrainingState`):

    IDLE --forward--> FORWARD --end of forward--> IDLE --pre-backward--> BACKWARD --released--> IDLE
    IDLE --forward inside backward (re-entrant recomputation)--> RECOMPUTE --end--> BACKWARD
    BACKWARD --forward inside backward (non-re-entrant recomputation)--> BACKWARD

A module unit tells the shared `Schedule` (schedule.py) what happens and drives its flat units; it
never calls the strategy.

[Note: releasing after backward]
A unit may be released in backward only when no pending autograd node still reads its values.
The gradient of a call's inputs is complete only after every node of that call has run (and any
other consumer of the inputs), so the inputs' multi-grad hook marks the end of that call's
backward; a unit called k times in one forward is released after the k-th one fires. The inputs
themselves are left untouched (wrapping them in an identity autograd Function would forbid the
module to modify its input in place). Three cases have no usable inputs hook:
- a forward with no input that requires grad (the root's token ids, the block after a frozen
  embedding): `untracked`, released when the backward ends (finish_micro_step);
- re-entrant activation checkpointing: the first forward ran under no_grad (nothing to track),
  the recomputation runs inside backward with inputs of its own (detached, requiring grad), and
  those are watched instead: the recomputed call's backward (run by the checkpoint's backward) ends
  when their gradients are in. If none requires grad, the unit is released once every trainable
  parameter it gathers has received its gradient, or at the end of backward if it gathers frozen ones;
- non-re-entrant checkpointing: the original forward's hook is in the graph and fires after the
  recomputed nodes ran; the recomputation itself (a forward during backward) only converts its
  acquire into the backward hold, and watches nothing (its graph is never run).
Gradients do not wait for any of this: a flat unit is reduced as soon as it is complete (see
strategy.py). But where the inputs hook sees the end of a call's backward, the unit's own flat units
end their round there too (`GradShard.end_of_backward`): a parameter that got no gradient on this rank
(an expert no token reached) is zero here, and every rank launches the reduction at the same point of
its backward ([Note: waiting before the control collective] in grads/reduce_queue.py).
Releasing too early would raise a storage error, never give a wrong value.

[Note: external parameters]
A parent's forward may read a parameter of a child unit directly, e.g. `F.linear(h,
self.embed.weight)` after `embed` (a unit) has run and been released. The read reaches
`PartitionedParameter.__torch_function__` (see [Note: partitioned parameters]), which asks the
strategy (the parameter's registered context) to gather the owner's flat unit on the spot and add it
to the running unit's gather set (`borrow`):
from then on the parent gathers it before its forward and its backward, like its own parameters.
This is a collective, so it relies on every rank running the same forward, as all of stage 3 does.
"""

from __future__ import annotations

from enum import Enum, auto

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ...comm import watchdog
from .flat_unit import FlatUnit
from .schedule import Schedule


class TrainingState(Enum):
    IDLE = auto()       # no forward running, not held for backward
    FORWARD = auto()    # its forward is running (outside backward)
    RECOMPUTE = auto()  # its forward is running inside backward, not yet held for backward
    BACKWARD = auto()   # gathered for its backward (the backward hold)
    KEPT = auto()       # root or last unit: its forward hold kept for its backward ([Note: the root stays gathered])


_ALLOWED = {
    TrainingState.IDLE: {TrainingState.FORWARD, TrainingState.RECOMPUTE, TrainingState.BACKWARD},
    TrainingState.FORWARD: {TrainingState.FORWARD, TrainingState.IDLE, TrainingState.KEPT},
    TrainingState.RECOMPUTE: {TrainingState.RECOMPUTE, TrainingState.BACKWARD},
    TrainingState.BACKWARD: {TrainingState.BACKWARD, TrainingState.IDLE},
    TrainingState.KEPT: {TrainingState.BACKWARD, TrainingState.IDLE},
}


class ModuleUnit:
    """A module whose forward gathers `gather_set`; see the module docstring for its hooks."""

    def __init__(self, module: nn.Module, name: str, flats: list[FlatUnit], schedule: Schedule, *,
                 is_root: bool) -> None:
        self.module = module
        self.name = name or "<root>"
        self.flats = flats                  # the flat units it owns
        self.gather_set = list(flats)       # what its forward needs: owned + borrowed
        self.schedule = schedule
        self.is_root = is_root
        self.state = TrainingState.IDLE
        self.holds = 0                      # active acquisitions (nested calls, the backward hold)
        # How the end of this unit's backward is detected, per backward pass (see [Note: releasing
        # after backward]): inputs hooks not yet fired, inputs hooks registered, and whether a
        # grad-enabled call had no input requiring grad.
        self.pending_post_backward = 0
        self.tracked_calls = 0
        self.untracked = False
        self.watched_forward = False        # a grad-enabled forward outside backward was watched this pass
        self.reductions = None              # the strategy's ReduceQueue: told when this unit's backward ends
        self._handles = []

    def _to(self, state: TrainingState) -> None:
        if state not in _ALLOWED[self.state]:
            raise RuntimeError(f"zerodp stage 3: module unit {self.name!r} cannot go from {self.state.name} to "
                               f"{state.name}")
        self.state = state

    def register_hooks(self, eager_under_compile: bool = False) -> None:
        pre, post = self._pre_forward, self._post_forward
        if eager_under_compile:
            # under `module.compile()` (engine.compile) dynamo would trace the hooks, whose state machine and
            # storage swaps it cannot capture: they run eagerly between compiled graphs (a graph break at
            # each unit, as DeepSpeed's stage-3 hooks). Only then: torch.compiler.disable imports dynamo (s).
            pre, post = torch.compiler.disable(pre), torch.compiler.disable(post)
        # prepend: gather before any user pre-hook that might read the parameters (weight norm)
        self._handles.append(self.module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        # always_call: release even when the forward raised
        self._handles.append(self.module.register_forward_hook(post, always_call=True))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def gathered_numel(self) -> int:
        """Elements this unit's forward adds to the gathered working set (persistent units excluded)."""
        return sum(f.layout.padded_numel for f in self.gather_set if not f.persistent)

    # -- holds ------------------------------------------------------------------------------------

    def acquire(self) -> None:
        self.holds += 1
        for f in self.gather_set:  # launch every gather first, so several flat units overlap
            f.acquire(wait=False)
        for f in self.gather_set:
            f.wait_for_unshard()

    def release(self) -> None:
        assert self.holds > 0, f"release of unit {self.name} without a matching acquire"
        self.holds -= 1
        for f in self.gather_set:
            f.release()

    def borrow(self, flat: FlatUnit) -> None:
        """Add another unit's flat unit to this unit's gather set, held as often as this unit is."""
        if flat in self.gather_set:
            return
        self.gather_set.append(flat)
        for _ in range(self.holds):
            flat.acquire()

    def release_backward_hold(self) -> None:
        if self.state in (TrainingState.BACKWARD, TrainingState.KEPT):
            self._to(TrainingState.IDLE)
            self.release()

    def end_backward(self) -> None:
        """The backward is over (the strategy's finish_micro_step): drop the hold and the per-pass bookkeeping."""
        self.release_backward_hold()
        assert self.state is TrainingState.IDLE, f"unit {self.name} ends a backward in state {self.state.name}"
        self.pending_post_backward = 0
        self.tracked_calls = 0
        self.untracked = False
        self.watched_forward = False

    # -- forward ----------------------------------------------------------------------------------

    def _pre_forward(self, module, args, kwargs):
        watchdog.activity().unit = self.name
        s = self.schedule
        if self.state is TrainingState.KEPT:
            self.release_backward_hold()  # the last forward had no backward: give its hold back
        if not s.in_backward:
            self._to(TrainingState.FORWARD)
        elif self.state is not TrainingState.BACKWARD:
            self._to(TrainingState.RECOMPUTE)
        s.enter_forward(self)
        self.acquire()
        s.prefetch_after(self)
        if torch.is_grad_enabled() and not s.in_backward:
            self._watch_inputs(args, kwargs)
        elif torch.is_grad_enabled() and not self.watched_forward and not self.untracked:
            # a re-entrant recomputation (the first forward ran under no_grad: nothing watched it); a
            # non-re-entrant one was watched in its first forward and its own graph never runs
            self._watch_inputs(args, kwargs, recomputed=True)

    @property
    def backward_end_seen(self) -> bool:
        """This pass's backward of the unit ends at an inputs hook, on every rank alike (module docstring)."""
        return self.tracked_calls > 0 and not self.untracked

    def _watch_inputs(self, args, kwargs, recomputed: bool = False) -> None:
        self.watched_forward = self.watched_forward or not recomputed
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs:
            if not recomputed:  # a recomputation without such inputs falls back to on_gradients_complete
                self.untracked = True
            return
        handle = None

        def on_inputs_grad(grads) -> None:
            handle.remove()  # once: a leaf input would otherwise keep the hook for later backwards
            self.post_backward()

        handle = torch.autograd.graph.register_multi_grad_hook(inputs, on_inputs_grad, mode="all")
        self.pending_post_backward += 1
        self.tracked_calls += 1

    def _post_forward(self, module, args, output):
        if self.state is TrainingState.RECOMPUTE:
            self._to(TrainingState.BACKWARD)  # keep the values for the backward to come
        else:
            # FORWARD: done (nested calls keep FORWARD until the outermost ends); BACKWARD: a
            # recomputation while already held for backward gives its extra hold back
            if self._keep_for_backward():
                # [Note: the root stays gathered] The root's backward comes right after its forward
                # (the loss is computed from the root's output), and FSDP keeps its root unsharded
                # between the two as well: the forward hold becomes the backward hold, which saves
                # one gather of the root's parameters per step. The same holds for the unit whose
                # forward started last in the previous step (a GPT's head when it is its own unit):
                # its backward is the first to run, so its gathered values are kept (as FSDP2 does
                # with reshard_after_forward=False on the last unit) and one gather of it is saved.
                # Only in training mode: an evaluation forward leaves nothing gathered.
                self._to(TrainingState.KEPT)
            else:
                self.schedule.keep_after_forward(self)  # inference: may stay gathered (inference_cache.py)
                self.release()
                if self.state is TrainingState.FORWARD and self.holds == 0:
                    self._to(TrainingState.IDLE)
        if torch.is_grad_enabled() and output is not None:
            nodes = {t.grad_fn for t in tree_flatten(output)[0]
                     if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None}
            for node in nodes:
                # A node pre-hook runs after the tensor hooks on the same gradient, so when this
                # output is the next unit's input, that unit is released before this one gathers.
                node.register_prehook(self._on_output_grad)
        self.schedule.exit_forward(self)

    # -- backward ---------------------------------------------------------------------------------

    def _keep_for_backward(self) -> bool:
        return ((self.is_root or self.schedule.ended_last_forward(self)) and self.module.training and self.state is TrainingState.FORWARD and self.holds == 1
                and torch.is_grad_enabled() and not self.schedule.in_backward)

    def _on_output_grad(self, grad_outputs) -> None:
        self.pre_backward()

    def pre_backward(self) -> None:
        """A gradient reached one of the unit's outputs: gather for the unit's backward."""
        if not self.schedule.in_backward:
            # a stray loss.backward(): refuse before anything is gathered or accumulated
            raise RuntimeError("zerodp: a backward was started outside engine.backward(loss); nothing was "
                               "accumulated; call engine.backward(loss) instead of loss.backward()")
        if self.state is TrainingState.BACKWARD:
            return
        watchdog.activity().unit = self.name
        self.schedule.record_backward(self)
        if self.state is not TrainingState.KEPT:  # KEPT: gathered and held since its forward
            self.acquire()
        self._to(TrainingState.BACKWARD)
        self.schedule.prefetch_after(self)

    def post_backward(self) -> None:
        """One forward call's backward is done (its inputs hook fired)."""
        self.pending_post_backward -= 1
        if self.pending_post_backward <= 0 and not self.untracked:
            self.release_backward_hold()
            for f in self.flats:
                if f.trainable:
                    f.grads.end_of_backward()
            if self.reductions is not None:
                self.reductions.launch_ready()

    def on_gradients_complete(self) -> None:
        """A flat unit got all its gradients: release here if no inputs hook can (re-entrant recompute)."""
        if self.state is not TrainingState.BACKWARD or self.tracked_calls or self.untracked:
            return
        if all(f.trainable and f.grads.complete for f in self.gather_set):
            self.release_backward_hold()

    def __repr__(self) -> str:
        return (f"ModuleUnit({self.name!r}, flats={[f.index for f in self.gather_set]}, {self.state.name}, "
                f"holds={self.holds})")
