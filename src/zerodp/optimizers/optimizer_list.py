"""Several optimizers over disjoint parameter sets, stepped as one: `OptimizerList`.

This is how Muon is used: torch's `Muon` refuses parameters that are not 2-D, so a model pairs
`Muon(matrices)` with `AdamW(everything else)`. `zerodp.initialize(model, [Muon(...), AdamW(...)])`
wraps the list in an `OptimizerList`; each member keeps its class, hyper-parameters and state.

To the rest of zerodp the list looks like one optimizer: `param_groups` is the members' groups
concatenated (the "user's group index" counts across members, so checkpoints, schedules and
`engine.get_lr()` see one list), and the members share one `state` dict, which is safe because
their parameters are disjoint (torch keys state by the parameter tensor).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch

from ..errors import OptimizerError


class OptimizerList:
    """Optimizers over disjoint parameters; `step()` steps each in turn."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        if not self.optimizers:
            raise OptimizerError("an empty list of optimizers; pass at least one")
        seen: dict[int, int] = {}
        for k, opt in enumerate(self.optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    if seen.setdefault(id(p), k) != k:
                        raise OptimizerError(f"optimizers {seen[id(p)]} and {k} of the list both hold a parameter "
                                             f"of shape {tuple(p.shape)}; each parameter belongs to one optimizer")
        self.state = defaultdict(dict)
        for opt in self.optimizers:
            self.state.update(opt.state)
            opt.state = self.state  # one dict: see the module docstring

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def defaults(self) -> dict:
        return self.optimizers[0].defaults

    def member_of_group(self) -> list[torch.optim.Optimizer]:
        """The member that owns each group of `param_groups`."""
        return [opt for opt in self.optimizers for _ in opt.param_groups]

    def step(self, closure=None):
        if closure is not None:
            raise OptimizerError("OptimizerList.step takes no closure")
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"OptimizerList({', '.join(type(o).__name__ for o in self.optimizers)})"
