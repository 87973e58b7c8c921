"""Parameters whose gradient came after a step they missed: `LateStarters`, a warning, not yet a fix.

[Note: one step count per chunk] torch's Adam-family optimizers keep a step count per parameter: a step
where a parameter has no .grad skips it, count included, and its bias correction (1 - beta^t) uses its own
t. zerodp's inner optimizer steps flat chunks of many parameters: a parameter that got no gradient on any
rank is left untouched (values and moments restored, optim/optimizer.py `_snapshot_untouched`), but its
chunk's count advances with the others. So when a parameter that missed a step (an MoE expert not routed, a
branch not taken, a head trained every other step) later gets a gradient, its update is corrected with the
chunk's count, not its own: AdamW's first update of a parameter first used at step 1000 is about 2.5 times
torch's. DeepSpeed's and FSDP1's flat parameters do the same; FSDP2 (per-parameter DTensors) does not.
Per-parameter counts are not implemented; this says so, once, naming the parameters, where training would
otherwise differ from torch.optim's in silence. Whole-tensor units (each parameter its own chunk, skipped
by torch when it has no gradient) keep torch's counts and are not watched.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

MAX_NAMED = 5


class LateStarters:
    """Watches, step by step, which parameters missed a step and later got a gradient (see above)."""

    def __init__(self, units: list, whole: list[bool]) -> None:
        self.units = units
        self.watched = [w for u, whole_tensors in zip(units, whole) for w in [not whole_tensors] * len(u.params)]
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
                          f"parameters do). Per-parameter step counts are not implemented yet ([Note: one step count "
                          f"per chunk] in zerodp/optim/late_starters.py); this is said once", stacklevel=3)
