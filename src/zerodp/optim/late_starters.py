"""Parameters whose gradient came after a step they missed, under an optimizer without per-parameter counts.

[Note: one step count per chunk] torch's Adam-family optimizers keep a step count per parameter: a step
where a parameter has no .grad skips it, count included, and its bias correction (1 - beta^t) uses its own
t. zerodp's inner optimizer steps flat chunks of many parameters: a parameter that got no gradient on any
rank is left untouched (values and moments restored, optim/optimizer.py `_snapshot_untouched`), but its
chunk's count advances with the others. For torch's Adam and AdamW and zerodp's FusedAdam, each parameter
keeps its own count and a parameter that missed a step is stepped with it (optim/step_counts.py, [Note: one
step count per parameter]): their units are not watched here. Other optimizers with a step count whose
update is not a slice-by-slice copy of Adam's (LAMB's per-tensor trust ratio, NAdam's mu product, RAdam,
Adamax, ...) still correct a late parameter (an MoE expert not routed, a branch not taken) with its chunk's
count, as DeepSpeed's and FSDP1's flat parameters do: this says so, once, naming the parameters, where
training would otherwise differ from torch.optim's in silence. Whole-tensor units (each parameter its own
chunk, skipped by torch when it has no gradient) keep torch's counts and are not watched either.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

MAX_NAMED = 5


class LateStarters:
    """Watches, step by step, which parameters missed a step and later got a gradient (see above)."""

    def __init__(self, units: list, exempt: list[bool]) -> None:
        """`exempt`: per unit, True where torch's counts are kept anyway (whole tensors, step_counts.py)."""
        self.units = units
        self.watched = [w for u, e in zip(units, exempt) for w in [not e] * len(u.params)]
        self.missed: Optional[list[bool]] = None  # per parameter (units concatenated): missed a step taken
        self.warned = False
        self.param_names: dict[int, list[str]] = {}  # set by the engine: id(parameter) -> its names

    def after_step(self, received: Optional[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        """After a step taken with `received` (host flags; None: every parameter got a gradient). Python lists, not
        tensor operations: nothing here reads a device value (tests/unit/test_step_syncs.py)."""
        if self.warned or received is None or not any("step" in s for s in inner.state.values()):
            return
        flags = received.tolist()
        if self.missed is None:
            self.missed = [w and not r for r, w in zip(flags, self.watched)]
            return
        late = [i for i, (r, m) in enumerate(zip(flags, self.missed)) if r and m]
        self.missed = [m or (w and not r) for r, m, w in zip(flags, self.missed, self.watched)]
        if late:
            self.warned = True
            params = [p for u in self.units for p in u.params]
            names = [self.param_names.get(id(params[i]), [f"#{i}"])[0] for i in late]
            shown = ", ".join(names[:MAX_NAMED]) + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")
            warnings.warn(f"zerodp: {shown} got a gradient after missing an earlier step; {type(inner).__name__} keeps one "
                          f"step count per flat chunk of parameters, so their bias correction uses the chunk's count, "
                          f"not their own, and their updates differ from torch.optim's (as DeepSpeed's and FSDP1's flat "
                          f"parameters do). zerodp keeps per-parameter counts for Adam, AdamW and FusedAdam only "
                          f"([Note: one step count per chunk] in zerodp/optim/late_starters.py); this is said once", stacklevel=3)
