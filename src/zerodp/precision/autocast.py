"""torch.autocast mixed precision, DeepSpeed's `torch_autocast` section: `AutocastPolicy`.

What it means (DeepSpeed >= 0.17, read from its runtime/torch_autocast.py and ZeRO optimizers):
- parameters, gradients, master weights and optimizer states stay fp32: there is no separate master copy
  and nothing is cast at initialization;
- the engine's forward runs under `torch.autocast(device_type, dtype)` (an enclosing autocast of the
  user's is overridden by the config's dtype), so the ops autocast lists (matmuls, convolutions, ...)
  compute in `dtype` from fp32 weights;
- the *lower-precision-safe* modules (exact classes, not subclasses; torch.nn.Linear and Conv1d/2d/3d
  unless the config names others) have their own parameters' gradients summed over ranks in `dtype`:
  each rank's fp32 gradient is cast to `dtype`, summed, divided by the world size in `dtype` and cast
  back to fp32. Every other parameter's gradient is summed in fp32.

zerodp holds the set of those parameters here and hands it to `grads.grad_arithmetic.GradArithmetic`
(`low_precision_ids`); stage 0-2 buckets never mix the two reduction dtypes, a stage-3 unit that holds
both reduces its two parts in two collectives (grads/split_reduce.py).

Where zerodp differs from DeepSpeed on purpose:
- stage 3 gathers parameters in fp32; DeepSpeed gathers the safe modules' parameters in `dtype`. The
  values the autocast ops see are the same (autocast casts the fp32 weight to `dtype` itself); what
  differs is a use of such a weight outside an autocast op (a weight tied to an embedding), where zerodp
  computes with the fp32 weight as plain PyTorch does, and the gather's bytes (fp32 here).
- without the section (or with enabled false), zerodp leaves a user's own enclosing autocast in force;
  DeepSpeed switches it off inside the engine's forward.
- fp16 autocast is refused (it needs torch's GradScaler), bf16 only.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

from ..config import ZeroConfig
from .policy import DTYPES

# DeepSpeed's default list of lower-precision-safe modules.
DEFAULT_SAFE_MODULES = ("torch.nn.Linear", "torch.nn.Conv1d", "torch.nn.Conv2d", "torch.nn.Conv3d")


def resolve_module_classes(names: Optional[list[str]]) -> tuple[type, ...]:
    """The classes the dotted names in `torch_autocast.lower_precision_safe_modules` name (unset: the default)."""
    classes = []
    for name in DEFAULT_SAFE_MODULES if names is None else names:
        package, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(package), attr) if package else None
        except ImportError as e:
            raise ValueError(f"torch_autocast.lower_precision_safe_modules: cannot import {name!r} ({e}); write "
                             f"a module class with its package, e.g. 'torch.nn.Linear'") from e
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"torch_autocast.lower_precision_safe_modules: {name!r} is not an nn.Module class; "
                             f"write one with its package, e.g. 'torch.nn.Linear'")
        classes.append(cls)
    return tuple(classes)


@dataclass(frozen=True)
class AutocastPolicy:
    """The forward's autocast dtype and the parameters whose gradients are reduced in it."""

    dtype: torch.dtype
    low_precision_ids: frozenset[int]  # id() of the safe modules' own parameters

    @classmethod
    def from_config(cls, config: ZeroConfig, model: nn.Module) -> Optional["AutocastPolicy"]:
        section = config.torch_autocast
        if not section.enabled:
            return None
        classes = resolve_module_classes(section.lower_precision_safe_modules)
        # type(m) in classes, not isinstance: DeepSpeed matches the exact class (a subclass may change the math)
        ids = frozenset(id(p) for m in model.modules() if type(m) in classes for p in m.parameters(recurse=False))
        return cls(DTYPES[section.dtype], ids)

    @contextlib.contextmanager
    def forward(self, module: nn.Module) -> Iterator[None]:
        """The forward's context: autocast on the device the parameters live on, in this policy's dtype."""
        first = next(module.parameters(), None)
        device_type = first.device.type if first is not None and first.device.type != "meta" else "cpu"
        with torch.autocast(device_type=device_type, dtype=self.dtype, enabled=True):
            yield
