"""`deepspeed.compression.helper.recursive_getattr` / `recursive_setattr`: reach a submodule by its dotted
name (`"decoder.layers.0.fc1"`), as `named_modules()` spells it, to read it or to replace it."""

from __future__ import annotations

from typing import Any


def recursive_getattr(model: Any, module_name: str) -> Any:
    """The object at the dotted path `module_name` under `model` (AttributeError names the missing part)."""
    target = model
    for part in module_name.split("."):
        target = getattr(target, part)
    return target


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Replace the object at the dotted path `module_name` under `model` by `module`."""
    parent_name, _, leaf = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_name) if parent_name else model
    setattr(parent, leaf, module)
