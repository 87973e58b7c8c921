"""Mixed-precision steps whose fp32 copies of the gradients exist one window of units at a time.

[Note: fp32 gradients at the step] With bf16 parameters and gradients, the fp32 masters need fp32
gradients (torch's optimizers want `grad.dtype == param.dtype`). Cast for every unit before the
step, those copies are 4 bytes per parameter of this rank's shard on top of the paper's 16 (2 + 2 +
12): the 5 GiB that zerodp stage 3 held beyond FSDP2 at 1.31B on one H100 (issue 32). Here the
global norm is taken from the 16-bit shards themselves (`square_norm` upcasts inside the reduction:
the same float32 value as the norm of the cast copy), and the copies are made, clipped, stepped and
dropped one window at a time: consecutive units of one group holding at most WINDOW_FRACTION of the
rank's elements (or one unit, if larger). Extra memory at the step: at most max(largest unit,
1/WINDOW_FRACTION of the shard) x 4 bytes instead of the whole shard x 4. The update is the same
per element, so results are bitwise those of one step over every chunk.

Taken only where that holds without further thought (`transient_grads_apply`): the elementwise
classes of optim/inner.py, whose state is per parameter (no LARC, no shard-aware norms, one optimizer), no loss scaling (bf16), nothing
offloaded and no step on the host (their plan steps in windows of its own: step_plan.py), no whole-tensor
units. `WindowedGradSteps` holds the `ShardedOptimizer` it steps and reads only its public members (`units`,
`masters`, `chunks`, `optimizer`, `group_indices`, `plan`, `step_inner`); the optimizer's step path
(step_path.py `TransientGradients`) calls its `run`.
"""

from __future__ import annotations

from typing import AbstractSet, Optional

import torch

from .inner import ELEMENTWISE

# a window holds at most 1/WINDOW_FRACTION of this rank's gradient elements (or one unit)
WINDOW_FRACTION = 8


def transient_grads_apply(opt) -> bool:
    """True when the `ShardedOptimizer` `opt` makes its fp32 gradient copies per window at the step (module
    docstring). Asked once, when the optimizer chooses its step path (step_path.py), from facts fixed at
    construction: a loss scale that may change (fp16's dynamic one) takes the other path for good."""
    if not opt.precision.mixed or opt.scaler.scale != 1.0 or opt.scaler.dynamic or opt.offload is not None \
            or opt.plan.per_unit or opt.plan.host_step:
        return False
    # zerodp's list of elementwise classes, whose state is per parameter: an optimizer the user only asserts
    # elementwise (zero_allow_untested_optimizer) may keep state per step() call, which windows would repeat
    if type(opt.optimizer) not in ELEMENTWISE or getattr(opt.optimizer, "shard_norms", None) \
            or opt.model_parallel is not None:  # tensor parallelism's norm rule reads the cast copies
        return False
    if any(unit.layout.whole_tensors or unit.grad_offloaded for unit in opt.units):
        return False
    return any(unit.grad_shard.dtype != master.dtype for unit, master in zip(opt.units, opt.masters))


class WindowedGradSteps:
    """The windowed step of [Note: fp32 gradients at the step] over the `ShardedOptimizer` `opt` (module docstring)."""

    def __init__(self, opt) -> None:
        self.opt = opt

    def _windows(self) -> list[list[int]]:
        """Consecutive unit indices of one inner group, at most a budget of elements each (or one unit)."""
        total = sum(m.numel() for m in self.opt.masters)
        budget = max(max((m.numel() for m in self.opt.masters), default=0), total // WINDOW_FRACTION)
        windows: list[list[int]] = []
        numel, group = 0, None
        for index, (unit, master) in enumerate(zip(self.opt.units, self.opt.masters)):
            if windows and unit.group_index == group and numel + master.numel() <= budget:
                windows[-1].append(index)
                numel += master.numel()
            else:
                windows.append([index])
                numel, group = master.numel(), unit.group_index
        return windows

    def run(self, clip: Optional[torch.Tensor], received: Optional[torch.Tensor],
                       late: AbstractSet[int] = frozenset()) -> None:
        """Cast, clip by `clip` (the coefficient, a tensor; None: no clipping), bind and step each window's gradients, then drop them (the norm is already taken).
        The `late` parameters are then stepped with their own counts (step_counts.py), while their window's copies
        live."""
        groups = self.opt.optimizer.param_groups
        all_params = [g["params"] for g in groups]
        try:
            for window in self._windows():
                chunks = [c for index in window for c in self.opt.chunks[index]]
                inner = self.opt.group_indices.index(self.opt.units[window[0]].group_index)
                for k, g in enumerate(groups):  # torch then walks only this window's chunks
                    g["params"] = chunks if k == inner else []
                for index in window:
                    master = self.opt.masters[index]
                    g = self.opt.units[index].grad_shard.to(master.dtype)
                    if clip is not None:  # always multiplied: x * 1.0 is x, and the host never reads the coefficient
                        g.mul_(clip)
                    self.opt.plan.bind(index, g, received)
                self.opt.step_inner(received, {id(c) for c in chunks}, late)
                for c in chunks:
                    c.grad = None  # the window's fp32 copies go here
        finally:
            for g, params in zip(groups, all_params):
                g["params"] = params
