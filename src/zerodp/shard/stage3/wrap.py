"""Which modules become units, and which unit holds each parameter. No tensors move here.

Unit modules: those whose class name is in `stage3_unit_modules`, or else (auto-wrap, as VISSL's
FSDP wrapping does) every module that holds at least `stage3_unit_min_params` parameter elements
not already claimed by a unit below it. The root is always a unit: it takes whatever is left.

A parameter is held by the innermost unit around the module that registers it. A parameter
registered by several modules (tied weights: `lm_head.weight is wte.weight`) is held by the
innermost unit around *all* of them (their lowest common ancestor in the unit tree), so every
module that uses it runs inside a unit that has it gathered; it is stored, gathered and reduced
once. A tied weight split across two units is therefore impossible by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ...config import ConfigError


@dataclass
class UnitPlan:
    """One future module unit: its module and the parameters it will hold, in model order."""

    name: str
    module: nn.Module
    params: list[nn.Parameter] = field(default_factory=list)
    names: list[str] = field(default_factory=list)


def choose_unit_modules(model: nn.Module, class_names: list[str], min_params: int) -> list[tuple[str, nn.Module]]:
    """The unit modules, root first, in `model.named_modules()` order."""
    named = list(model.named_modules())
    if class_names:
        present = {type(m).__name__ for _, m in named}
        unknown = sorted(set(class_names) - present)
        if unknown:
            raise ConfigError(f"zero_optimization.stage3_unit_modules names {unknown}, but the model has no module "
                              f"of that class; classes present: {', '.join(sorted(present))}")
        chosen = {id(m) for _, m in named if type(m).__name__ in class_names}
    else:
        chosen = _auto_wrap(model, min_params)
    chosen.add(id(model))
    return [(name, m) for name, m in named if id(m) in chosen]


def _auto_wrap(model: nn.Module, min_params: int) -> set[int]:
    chosen: set[int] = set()
    unclaimed: dict[int, int] = {}

    def visit(m: nn.Module) -> int:
        if id(m) in unclaimed:  # a module reachable twice is counted once
            return 0
        own = sum(p.numel() for p in m._parameters.values() if p is not None)
        below = sum(visit(c) for c in m.children())
        total = own + below
        if m is not model and total > 0 and total >= min_params:
            chosen.add(id(m))
            total = 0
        unclaimed[id(m)] = total
        return total

    visit(model)
    return chosen


def plan_units(model: nn.Module, unit_modules: list[tuple[str, nn.Module]]) -> list[UnitPlan]:
    """Assign every parameter to one unit (see the module docstring); returns plans in unit order."""
    parent: dict[int, nn.Module] = {}
    for m in model.modules():
        for c in m.children():
            parent.setdefault(id(c), m)
    unit_index = {id(m): i for i, (_, m) in enumerate(unit_modules)}

    def enclosing_unit(m: nn.Module) -> int:
        while id(m) not in unit_index:
            m = parent[id(m)]
        return unit_index[id(m)]

    def unit_chain(i: int) -> list[int]:
        chain = [i]
        m = unit_modules[i][1]
        while m is not model:
            i = enclosing_unit(parent[id(m)])
            chain.append(i)
            m = unit_modules[i][1]
        return chain

    owners: dict[int, list[int]] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(enclosing_unit(m))
    plans = [UnitPlan(name, m) for name, m in unit_modules]
    for name, p in model.named_parameters():
        chains = [unit_chain(i) for i in owners[id(p)]]
        common = [u for u in chains[0] if all(u in c for c in chains[1:])]
        plan = plans[common[0]]  # the innermost unit enclosing every registering module
        plan.params.append(p)
        plan.names.append(name)
    return plans
