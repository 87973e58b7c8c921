"""`deepspeed.utils.set_z3_leaf_modules`: module classes whose instances stage 3 gathers whole, as one unit.

DeepSpeed's meaning: a "leaf" module's parameters are all fetched when the module runs, and none of its submodules
gets hooks of its own. It is there for mixture-of-experts blocks, where each rank routes its tokens to some experts
only: per-expert gathers would be collectives some ranks never reach (a hang), so the whole block is fetched at once.

zerodp gathers stage-3 parameters per unit, a module chosen by `zero_optimization.stage3_unit_modules` (class names)
or by size. `set_z3_leaf_modules(model, classes)` records the classes for `model`, and `deepspeed.initialize` adds
their names to `stage3_unit_modules`: each instance becomes one unit, gathered when it starts and never below.
With names given, zerodp makes units only of the named classes (the rest of the model's parameters are in the root
unit), so a config naming none gets the leaf classes alone. A class the config names that sits inside a leaf module
would split it again, and is refused. Below stage 3 nothing is gathered and the call changes nothing (as in
DeepSpeed). The record is kept per model (weakly), not on the modules.
"""

from __future__ import annotations

import weakref
from typing import Iterable

from torch import nn

from ....config import ConfigError

# model -> the leaf classes set for it (weak: forgotten with the model)
_LEAF_CLASSES: "weakref.WeakKeyDictionary[nn.Module, tuple[type, ...]]" = weakref.WeakKeyDictionary()

__all__ = ["set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
           "leaf_unit_modules"]


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Iterable) -> list[nn.Module]:
    """Make every instance of `leaf_module_classes` (classes, or class names) in `model` one stage-3 unit; returns
    those instances. Call before `deepspeed.initialize`."""
    classes = tuple(leaf_module_classes)
    found = [m for m in model.modules() if any(_is(m, c) for c in classes)]
    if not found:
        raise ValueError(f"set_z3_leaf_modules: no module of {[_name(c) for c in classes]} in the model")
    _LEAF_CLASSES[model] = tuple(dict.fromkeys(_LEAF_CLASSES.get(model, ()) + classes))
    return found


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Iterable) -> list[nn.Module]:
    """Undo `set_z3_leaf_modules` for these classes; returns the instances no longer leaves."""
    classes = tuple(leaf_module_classes)
    _LEAF_CLASSES[model] = tuple(c for c in _LEAF_CLASSES.get(model, ()) if c not in classes)
    return [m for m in model.modules() if any(_is(m, c) for c in classes)]


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that are leaves."""
    classes = _LEAF_CLASSES.get(model, ())
    return [m for m in model.modules() if any(_is(m, c) for c in classes)]


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether `module` is a leaf of a model it was set for."""
    return any(any(_is(module, c) for c in classes) and any(m is module for m in model.modules())
               for model, classes in list(_LEAF_CLASSES.items()))


def leaf_unit_modules(model: nn.Module, configured: list[str]) -> list[str]:
    """`stage3_unit_modules` for `model`: the configured class names plus its leaf classes' (module docstring)."""
    leaves = get_z3_leaf_modules(model)
    if not leaves:
        return list(configured)
    inside = sorted({type(sub).__name__ for leaf in leaves for sub in leaf.modules()
                     if sub is not leaf and type(sub).__name__ in configured})
    if inside:
        raise ConfigError(f"zero_optimization.stage3_unit_modules names {inside}, which sit inside modules set as "
                          f"stage-3 leaves (set_z3_leaf_modules): a leaf is gathered whole; remove them from "
                          f"stage3_unit_modules")
    return list(dict.fromkeys([*configured, *(type(m).__name__ for m in leaves)]))


def _is(module: nn.Module, cls) -> bool:
    return type(module).__name__ == cls if isinstance(cls, str) else isinstance(module, cls)


def _name(cls) -> str:
    return cls if isinstance(cls, str) else cls.__name__
