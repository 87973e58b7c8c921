"""The calling convention of a checkpointed region: keyword arguments folded into positional ones,
outputs split into the tensors autograd tracks and the rest, and the autocast state the forward ran
under, re-entered for the recomputation (which runs in backward, outside the caller's autocast).

DeepSpeed's `checkpoint(function, *args, **kwargs)` treats a keyword tensor like a positional one
(it is kept, restored and gets a gradient); so does zerodp. Outputs may be a tensor, or a tuple or
list mixing tensors and other values; the region returns the same structure.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

AUTOCAST_DEVICES = ("cpu", "cuda")


def bind_keywords(function: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple]:
    """A function of positional arguments only, and those arguments (`args` then the keyword values)."""
    if not kwargs:
        return function, tuple(args)
    names, count = tuple(kwargs), len(args)

    def positional(*flat: Any) -> Any:
        return function(*flat[:count], **dict(zip(names, flat[count:])))

    return positional, tuple(args) + tuple(kwargs.values())


def split_outputs(outputs: Any) -> tuple[tuple, Callable[[tuple], Any]]:
    """(the tensors among `outputs`, a function putting new tensors back in their places)."""
    if isinstance(outputs, torch.Tensor):
        return (outputs,), lambda tensors: tensors[0]
    if not isinstance(outputs, (tuple, list)):
        raise TypeError(f"a checkpointed region must return a tensor or a tuple/list of values, got "
                        f"{type(outputs).__name__}")
    kind = type(outputs)
    where = [i for i, value in enumerate(outputs) if isinstance(value, torch.Tensor)]
    others = [None if isinstance(value, torch.Tensor) else value for value in outputs]  # no tensor kept alive

    def rebuild(tensors: tuple) -> Any:
        values = list(others)
        for i, tensor in zip(where, tensors):
            values[i] = tensor
        return kind(values) if kind in (tuple, list) else kind(*values)

    return tuple(outputs[i] for i in where), rebuild


def capture_autocast() -> dict[str, tuple[bool, torch.dtype]]:
    """Whether autocast is on, and its dtype, for each device type (at a region's forward)."""
    return {device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in AUTOCAST_DEVICES}


@contextlib.contextmanager
def autocast_as(state: dict[str, tuple[bool, torch.dtype]]) -> Iterator[None]:
    """Run the block under the captured autocast state (the recomputation must cast as the forward did)."""
    with contextlib.ExitStack() as stack:
        for device, (enabled, dtype) in state.items():
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
        yield
