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
import torch

MAX_NAMED = 5


class LateStarters:
    """Says once which parameters missed a step and later got a gradient (see above): those `StepCounts.late` finds in
    the units whose counts it does not correct."""

    def __init__(self, units: list) -> None:
        self.units = units
        self.warned = False
        self.param_names: dict[int, list[str]] = {}  # set by the engine: id(parameter) -> its names

    def after_step(self, late: set[int], inner: torch.optim.Optimizer) -> None:
        """After a step taken, in which the `late` parameters (indices, units concatenated) got a gradient with a
        count behind their chunk's."""
        if self.warned or not late or not any("step" in s for s in inner.state.values()):
            return
        self.warned = True
        params = [p for u in self.units for p in u.params]
        names = [self.param_names.get(id(params[i]), [f"#{i}"])[0] for i in sorted(late)]
        more = f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else ""
        warnings.warn(f"zerodp: {', '.join(names[:MAX_NAMED])}{more} got a gradient after missing an earlier step; "
                      f"{type(inner).__name__} keeps one step count per flat chunk of parameters, so their bias "
                      f"correction uses the chunk's count, not their own, and their updates differ from torch.optim's "
                      f"(as DeepSpeed's and FSDP1's flat parameters do). zerodp keeps per-parameter counts for Adam, "
                      f"AdamW and FusedAdam only ([Note: one step count per chunk] in zerodp/optim/late_starters.py); "
                      f"this is said once", stacklevel=3)
