"""The post-accumulate-grad hook of one parameter of a `grads.grad_shard.GradShard`: `param_hook`.

Stage 3's units, stage 2's buckets, and stage 0-1 buckets while they learn their trigger (or whose gradient
order changes: grads/bucket_intake.py) hook every parameter with it.

[Note: hook cost] The hook runs once per parameter per backward, inside autograd's AccumulateGrad node, so its
common case (FILLING: the gradient accumulated into its buffer view, or one copy or add) runs inline, without
further Python calls: its per-parameter flags are bytearrays (a tensor element write is a dispatcher call,
microseconds) and the full buffer's per-parameter tensors are made once (flat/buffer.py `FlatBuffer.aliases`).
torch's dispatch of a Python hook costs about 1.4 us a call whatever its body (bench/results/host_profile.md),
which is why stages 0-1 hook one parameter per bucket where they can.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .grad_shard import GradShard
from .grad_state import GradState

STRAY = ("zerodp: a gradient was accumulated outside engine.backward(loss) and was discarded; call "
         "engine.backward(loss) instead of loss.backward()")


def param_hook(g: GradShard, index: int, gate, on_complete: Callable[[], None],
               on_stray: Optional[Callable[[], object]] = None) -> Callable[[torch.Tensor], None]:
    """The hook of `g`'s parameter `index`: refuse a gradient unless `gate.in_backward` (discarding it, and
    whatever `on_stray` discards), take it in (`GradShard.add_grad`'s work), and call `on_complete` when this
    round's last parameter reports."""
    view = g.views[index]
    count = len(g.params)
    filling = GradState.FILLING
    views = g.grad_views

    def hook(param: torch.Tensor) -> None:
        if not gate.in_backward:
            param.grad = None  # discarded: it would otherwise be added silently into the next step
            if on_stray is not None:
                on_stray()  # and the other buckets' (bucket_intake: theirs are not hooked each)
            raise RuntimeError(STRAY)
        grad = param.grad
        if grad is None:
            return
        if g.state is not filling:
            g.add_grad(index)  # a state transition: the general path, which marks the parameter itself
            if g._num_reported == count:
                on_complete()
            return
        if views and grad is view:
            pass  # autograd added it in place
        else:
            written = g._written
            if written is not None and not written[index]:
                view.copy_(grad)
                written[index] = 1
            else:
                view.add_(grad)
            param.grad = None
        reported = g._reported
        if not reported[index]:
            reported[index] = 1
            g._num_reported += 1
            if not g.rounds_launched:
                g.last_reported = index
            if g._num_reported == count:
                on_complete()
        g._received[index] = 1
    return hook
