"""Module units and their hooks: gather before a unit's forward and backward, release after them.

A `ModuleUnit` is a module (a transformer block, or the root) whose forward needs a set of flat
units: its own (one per optimizer group, plus frozen) and any it borrows (see
[Note: external parameters]). Its hooks drive the unit through one training step:

    forward pre-hook   acquire (gather, or wait for the prefetch), prefetch what runs next,
                       and watch the inputs' gradients (a multi-grad hook, "all" mode)
    forward post-hook  release (the storage is freed), and hook the outputs' gradients
    outputs node hook  the unit's backward is about to run: acquire again (pre-backward)
    inputs grad hook   the backward of that call is done: release (post-backward)

[Note: releasing after backward]
A unit may be released in backward only when no pending autograd node still reads its values.
The gradient of a call's inputs is complete only after every node of that call has run (and any
other consumer of the inputs), so the inputs' multi-grad hook marks the end of that call's
backward; a unit called k times in one forward is released after the k-th one fires. The inputs
themselves are left untouched (wrapping them in an identity autograd Function would forbid the
module to modify its input in place). Three cases have no usable inputs hook:
- a forward with no input that requires grad (the root's token ids, the block after a frozen
  embedding): `untracked`, released when the backward ends (flush);
- re-entrant activation checkpointing: the first forward ran under no_grad (nothing to track),
  the recomputation runs inside backward; then the unit is released once every trainable
  parameter it gathers has received its gradient, or at flush if it gathers frozen ones;
- non-re-entrant checkpointing: the original forward's hook is in the graph and fires after the
  recomputed nodes ran; the recomputation itself (a forward during backward) only converts its
  acquire into the backward hold, and watches nothing (its graph is never run).
Gradients never wait for any of this: they are reduced when each flat unit is complete (see
strategy.py). Releasing too early would raise a storage error, never give a wrong value.

[Note: external parameters]
A parent's forward may read a parameter of a child unit directly, e.g. `F.linear(h,
self.embed.weight)` after `embed` (a unit) has run and been released. The read reaches
`PartitionedParameter.__torch_function__` (see [Note: partitioned parameters]), which asks the
strategy to gather the owner's flat unit on the spot and add it to the running unit's gather set:
from then on the parent gathers it before its forward and its backward, like its own parameters.
This is a collective, so it relies on every rank running the same forward, as all of stage 3 does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .flat_unit import FlatUnit

if TYPE_CHECKING:
    from .strategy import Stage3Sharding


class ModuleUnit:
    """A module whose forward gathers `gather_set`; see the module docstring for its hooks."""

    def __init__(self, module: nn.Module, name: str, flats: list[FlatUnit], strategy: "Stage3Sharding") -> None:
        self.module = module
        self.name = name or "<root>"
        self.flats = flats                  # the flat units it owns
        self.gather_set = list(flats)       # what its forward needs: owned + borrowed
        self.strategy = strategy
        self.holds = 0                      # active acquisitions (nested calls, the backward hold)
        self.backward_hold = False          # acquired for backward, not yet released
        self.pending_post_backward = 0      # inputs hooks not yet fired
        self.tracked_calls = 0              # inputs hooks registered since the last backward ended
        self.untracked = False              # a grad-enabled call had no input requiring grad
        self._handles = []
        for f in flats:
            f.module_unit = self

    def register_hooks(self) -> None:
        # prepend: gather before any user pre-hook that might read the parameters (weight norm)
        self._handles.append(self.module.register_forward_pre_hook(self._pre_forward, with_kwargs=True,
                                                                   prepend=True))
        # always_call: release even when the forward raised
        self._handles.append(self.module.register_forward_hook(self._post_forward, always_call=True))

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
        if self.backward_hold:
            self.backward_hold = False
            self.release()

    def end_backward(self) -> None:
        """The backward is over (flush): drop the hold and the per-pass bookkeeping."""
        self.release_backward_hold()
        self.pending_post_backward = 0
        self.tracked_calls = 0
        self.untracked = False

    # -- forward ----------------------------------------------------------------------------------

    def _pre_forward(self, module, args, kwargs):
        s = self.strategy
        s.enter_forward(self)
        self.acquire()
        s.prefetch_after(self)
        if torch.is_grad_enabled() and not s.in_backward:
            self._watch_inputs(args, kwargs)

    def _watch_inputs(self, args, kwargs) -> None:
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs:
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
        s = self.strategy
        if s.in_backward:
            # a recomputation (activation checkpointing): keep the values for the backward to come
            if self.backward_hold:
                self.release()
            else:
                self.backward_hold = True
        else:
            self.release()
        if torch.is_grad_enabled() and output is not None:
            nodes = {t.grad_fn for t in tree_flatten(output)[0]
                     if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None}
            for node in nodes:
                # A node pre-hook runs after the tensor hooks on the same gradient, so when this
                # output is the next unit's input, that unit is released before this one gathers.
                node.register_prehook(self._on_output_grad)
        s.exit_forward(self)

    # -- backward ---------------------------------------------------------------------------------

    def _on_output_grad(self, grad_outputs) -> None:
        self.pre_backward()

    def pre_backward(self) -> None:
        """A gradient reached one of the unit's outputs: gather for the unit's backward."""
        if self.backward_hold:
            return
        s = self.strategy
        s.record_backward(self)
        self.acquire()
        self.backward_hold = True
        s.prefetch_after(self)

    def post_backward(self) -> None:
        """One forward call's backward is done (its inputs hook fired)."""
        self.pending_post_backward -= 1
        if self.pending_post_backward <= 0 and not self.untracked:
            self.release_backward_hold()

    def on_gradients_complete(self) -> None:
        """A flat unit got all its gradients: release here if no inputs hook can (re-entrant recompute)."""
        if not self.backward_hold or self.tracked_calls or self.untracked:
            return
        if all(f.trainable and f.complete for f in self.gather_set):
            self.release_backward_hold()

    def __repr__(self) -> str:
        return f"ModuleUnit({self.name!r}, flats={[f.index for f in self.gather_set]}, holds={self.holds})"
