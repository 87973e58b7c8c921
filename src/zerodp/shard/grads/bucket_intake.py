"""A bucket's gradients taken in with one hook, not one per parameter: `BucketIntake` (stages 0-1).

[Note: arrivals read from version counters]
A Python hook per parameter costs torch's dispatch of it (about 1.4 us a call on the proxy CPU: the
GIL and the tensor's wrapping, whatever the hook does; bench/results/host_profile.md), once per
parameter per backward. Where a bucket's gradient buffer persists and has the parameters' dtype
(stages 0-1), each parameter's .grad is its alias of the buffer during a backward ([Note: gradients
as buffer views] in grads/grad_shard.py) and autograd adds into it in place. An in-place add bumps
that alias's version counter, and only that one's (flat/buffer.py `FlatBuffer.aliases`). So one
hook, on the parameter whose gradient completes the bucket (its trigger), reads every alias's
version: the changed ones got a gradient (0.05 us each), and the bucket's reduction launches then,
where the hook per parameter would have launched it.

Modes (`Mode`), per bucket:
- LEARNING, the first backward: a hook per parameter, as before; the gradient shard remembers which
  parameter was heard from last in the first round (`GradShard.last_reported`: the one that
  completed the bucket, or the last one used). That parameter becomes the trigger.
- TRIGGER: one hook. A gradient that comes after the launch finds no alias to add into (launch takes
  them back), so autograd leaves a fresh .grad, and the end of the backward (`settle`) takes it in as
  a late gradient: another round, which the control collective has every rank run (grads/
  reduce_queue.py). A second gradient of a parameter heard from before the launch (a weight in two
  re-entrant checkpointed regions) is late under the hook per parameter too: the same rounds, the
  same sums. But a late parameter *not* heard from before the launch, or a trigger that never fired
  while others did, means the order changed: the bucket goes to PER_PARAMETER for good. In that one
  backward the late gradients were summed in a second round (the same value, another rounding than
  one round would give), so a model whose gradient order changes is not bitwise the hook per
  parameter's in that step; a static one is bitwise in every step.
- PER_PARAMETER: a hook per parameter (grads/param_hook.py).

What a version cannot tell: an in-place write into an alias that is not autograd's. User code that, during
the backward, writes into another parameter's .grad (a hook that scales every .grad) marks that parameter as having a
gradient, so one that got none in the step is stepped (with the zeros its buffer holds: weight decay and momentum
move it) where plain PyTorch, and the hook per parameter, leave it alone. Values added are always right.

Where the buffer's dtype differs from the parameters' (bf16 parameters, `grad_accum_dtype` fp32) no
alias can be a .grad: autograd would sum a second gradient with the first in bf16 before any hook
saw it, so those buckets keep a hook per parameter. A gradient accumulated outside engine.backward
(a stray loss.backward()) is refused by any hook it reaches, which discards every bucket's stray
.grads first; one that reached no hook is found and refused at the next engine.backward, before
anything is added (`strays`).
"""

from __future__ import annotations

import operator
from enum import Enum, auto
from typing import Callable

import torch

from .grad_shard import GradShard, GradState
from .param_hook import STRAY


class Mode(Enum):
    LEARNING = auto()       # a hook per parameter, noting which one completes the bucket
    TRIGGER = auto()        # one hook, on that parameter
    PER_PARAMETER = auto()  # a hook per parameter for good: the order changed


class BucketIntake:
    """Which of a `GradShard`'s parameters carry a hook, and what the trigger's hook reads (see above)."""

    def __init__(self, grads: GradShard) -> None:
        if not (grads.keep_full and grads.grad_views):
            raise AssertionError("a bucket intake reads aliases of a buffer that persists over the backward "
                                 "(stages 0-1, the parameters' dtype)")
        self.grads = grads
        self.params = grads.params
        self.mode = Mode.LEARNING
        self.trigger = -1
        self.fired = False          # the trigger's hook ran in this backward
        self._seen = [a._version for a in grads.views]

    def _foreign(self) -> list[int]:
        """Parameters (indices) whose .grad is set and is not their alias: autograd's own tensor (a gradient after
        the launch took the aliases back), or one set outside the engine."""
        pairs = zip(self.params, self.grads.views)
        return [i for i, (p, a) in enumerate(pairs) if p.grad is not None and p.grad is not a]

    def strays(self) -> list[torch.nn.Parameter]:
        """Parameters holding a .grad no backward of the engine's put there (before a backward: stray ones). An
        alias is none: a backward that raised before its end left it attached."""
        return [self.params[i] for i in self._foreign()]

    def begin(self) -> None:
        """At the start of a backward, after the aliases were attached: versions from now on are arrivals."""
        self.fired = False
        if self.mode is Mode.TRIGGER:
            self._seen = [a._version for a in self.grads.views]

    def make_hook(self, gate, on_complete: Callable[[], None],
                  on_stray: Callable[[], object]) -> Callable[[torch.Tensor], None]:
        """The trigger's post-accumulate-grad hook: mark what arrived, close the round, launch what is ready."""
        g = self.grads

        def hook(param: torch.Tensor) -> None:
            if not gate.in_backward:
                on_stray()
                raise RuntimeError(STRAY)
            if param.grad is None or g.state is GradState.REDUCING or g.state is GradState.REDUCED:
                return  # a second gradient after the launch: `settle` takes it in (another round)
            self._scan()
            self.fired = True
            g.close_round()
            on_complete()
        return hook

    def _scan(self) -> None:
        """Mark the parameters whose alias autograd added into since the last look. After a launch the aliases
        are detached, so only a gradient added before it shows here (it went into the launched round): one that
        came after the trigger, while the queue held the launch back for an earlier bucket, is marked at `settle`."""
        versions = [a._version for a in self.grads.views]
        if versions != self._seen:
            arrived = bytes(map(operator.ne, versions, self._seen))  # 1 where the version moved
            self._seen = versions
            self.grads.mark_many(arrived)

    def settle(self) -> bool:
        """At the end of a backward: take in what is left and choose the next mode. True when the hooked
        parameters changed (the caller re-registers the hooks)."""
        g = self.grads
        if self.mode is Mode.LEARNING:
            if g.last_reported < 0:
                return False  # nothing heard from yet: learn from the next backward
            self.mode, self.trigger = Mode.TRIGGER, g.last_reported
            return True
        if self.mode is Mode.PER_PARAMETER:
            return False
        self._scan()
        before = g.reported  # heard from before any late gradient (a late one's round clears the flags)
        late = self._foreign()
        for i in late:
            g.add_grad(i)  # after the launch: another round; before it (a .grad set by hand): added in
            self._seen[i] = g.views[i]._version  # our own add is not an arrival
        if any(not before[i] for i in late) or (not self.fired and any(before)):
            self.mode = Mode.PER_PARAMETER  # the order changed (see the module docstring)
            return True
        return False
