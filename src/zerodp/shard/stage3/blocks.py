"""The model's repeated blocks: the module classes stage 3's default unit policy never splits.

A unit below a block is gathered only when its module runs, and whether it runs can depend on the data:
a Mixture-of-Experts block calls an expert only when some token is routed to it, so ranks with different
tokens gather different experts ([Note: mixed gathers] in gather_ledger.py). Keeping every block whole
makes each rank's gather sequence depend on the model's structure alone. The block classes are, in order:

1. HF transformers' `_no_split_modules` (the classes its own device maps never split), read from every
   module that declares it, kept when the model has a module of that class;
2. else the class repeated in the model's largest `nn.ModuleList` (most parameters; ties: the outermost),
   as FSDP's transformer auto-wrap is configured with the model's layer class: a classic MoE's
   `blocks` list holds every expert, so its class wins over the `experts` list inside it;
3. else none (no list of blocks): units are chosen by size alone.

A block becomes a unit when it holds at least `stage3_unit_min_params` elements; a smaller one stays
with the unit around it. Nothing inside a block is ever a unit of its own (wrap.py).
"""

from __future__ import annotations

import collections

from torch import nn


def repeated_block_classes(model: nn.Module) -> set[str]:
    """Class names of `model`'s repeated blocks (module docstring); empty when it has none."""
    present = {type(m).__name__ for m in model.modules()}
    declared: set[str] = set()
    for m in model.modules():
        names = getattr(m, "_no_split_modules", None)
        if isinstance(names, (list, tuple, set)):
            declared.update(n for n in names if isinstance(n, str))
    if declared & present:
        return declared & present
    best, best_numel = None, -1
    for m in model.modules():  # parents come before their children: the first of equal lists is the outermost
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            numel = sum(p.numel() for p in m.parameters())
            if numel > best_numel:
                best, best_numel = m, numel
    if best is None:
        return set()
    counts = collections.Counter(type(c).__name__ for c in best)
    return {counts.most_common(1)[0][0]}
