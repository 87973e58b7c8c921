"""What a parameter is while only its shard exists: `PartitionedParameter`, and the owner registry.

[Note: partitioned parameters]
Every parameter of a sharded unit keeps its true shape, dtype and requires_grad for its whole life:
its `.data` is a view into the unit's flat gathered buffer, and while the unit is sharded that
buffer's storage is released (`untyped_storage().resize_(0)`, see [Note: freeing storage]). So
`p.shape` and `p.numel()` are always right (no `torch.Size([0])` placeholder to trip over), and the
references autograd saved during forward stay valid: re-gathering re-attaches bytes under the same
storage object, so backward reads the gathered values through them.

While its unit is sharded, a parameter's class is switched to `PartitionedParameter`, whose
`__torch_function__` lets metadata through (shape, dtype, requires_grad, .grad, hooks) and turns
any use of the values into a `PartitionedParameterError` that names `zerodp.gathered_parameters`,
instead of torch's "storage of size 0" error or, worse, a silent wrong value (before any engine holds
an init_context parameter, `detach()` gives a meta tensor of its shape instead: `Module.state_dict()`'s
key names, which transformers reads while loading a checkpoint). The one exception is
a read during some module's forward (a parent calling `F.linear(h, self.embed.weight)` where
`embed` is a unit of its own): the running unit then gathers the owner on the spot and keeps it in
its own gather set from then on (see [Note: external parameters] in module_unit.py). While gathered, the
class is plain `nn.Parameter` again, so compute pays nothing for the check.

The registry maps a parameter to the flat unit that holds it and to that unit's `ShardContext`
(the stage-3 strategy, or init_context while a model is built), so that `gathered_parameters(params)`
needs nothing but the parameters, and a read of a sharded parameter reaches the layer that decides
what to do without the unit pointing back up. It is keyed by `id()` with a weak reference to the
parameter (tensors cannot be WeakKeyDictionary keys: `==` is elementwise), and holds no configuration.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ...errors import PartitionedParameterError


_Tensor = torch.Tensor
# Functions that only read metadata (or manage gradients and hooks): safe on a partitioned parameter.
_METADATA = {
    _Tensor.shape.__get__, _Tensor.size, _Tensor.dim, _Tensor.ndim.__get__, _Tensor.numel, _Tensor.nelement,
    _Tensor.dtype.__get__, _Tensor.device.__get__, _Tensor.layout.__get__, _Tensor.element_size,
    _Tensor.requires_grad.__get__, _Tensor.requires_grad.__set__, _Tensor.requires_grad_,
    _Tensor.grad.__get__, _Tensor.grad.__set__, _Tensor.is_leaf.__get__, _Tensor.grad_fn.__get__,
    _Tensor.is_floating_point, _Tensor.is_complex, _Tensor.is_cuda.__get__, _Tensor.is_sparse.__get__,
    _Tensor.is_meta.__get__, _Tensor.is_quantized.__get__, _Tensor.stride,
    _Tensor.register_hook, _Tensor.register_post_accumulate_grad_hook, _Tensor._backward_hooks.__get__,
    _Tensor.__hash__, _Tensor.get_device, torch._has_compatible_shallow_copy_type,
}

class ShardContext(Protocol):
    """What decides about a sharded parameter's owner beyond the owner itself (the stage-3 strategy,
    or init_context's record while the model is built)."""

    def gather_on_access(self, owner: Any, owners: list) -> bool:
        """A sharded parameter of `owner` was read (with `owners`, those of the operation's other
        sharded arguments): gather it on the spot and return True, or return False (an error)."""


_OWNERS: dict[int, tuple[weakref.ref, Any, Any]] = {}


def register_owner(param: nn.Parameter, unit: Any, context: ShardContext) -> None:
    """Record that `unit` holds `param` (a FlatUnit, or init_context's record of a parameter built
    sharded) under `context`. Owners implement `name_of(param)` and `module_name`."""
    key = id(param)
    _OWNERS[key] = (weakref.ref(param, lambda _ref, key=key: _OWNERS.pop(key, None)), unit, context)


def _entry(param: torch.Tensor):
    entry = _OWNERS.get(id(param))
    return None if entry is None or entry[0]() is not param else entry


def owner_of(param: torch.Tensor) -> Optional[Any]:
    """The owner of `param` (see register_owner), or None for a parameter zerodp does not partition."""
    entry = _entry(param)
    return None if entry is None else entry[1]


def context_of(param: torch.Tensor) -> Optional[ShardContext]:
    """The context `param` was registered under (see register_owner), or None."""
    entry = _entry(param)
    return None if entry is None else entry[2]


def unregister_owner(param: nn.Parameter) -> None:
    _OWNERS.pop(id(param), None)


class PartitionedParameter(nn.Parameter):
    """The class of a stage-3 parameter while its unit is sharded; see [Note: partitioned parameters].

    Never constructed: zerodp switches an existing parameter's `__class__` to it when the unit's
    storage is released, and back to `nn.Parameter` when the unit is gathered.
    """

    def __repr__(self) -> str:
        return (f"PartitionedParameter(shape={tuple(self.shape)}, dtype={self.dtype}, requires_grad="
                f"{self.requires_grad}: sharded by zerodp stage 3; read it inside zerodp.gathered_parameters)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if _is_no_op(func, args, kwargs):  # model.to(dtype) where the dtype is already right
            return args[0]
        if func is _Tensor.detach and _built_before_engine(args[0]):
            # Module.state_dict() detaches every parameter; transformers calls it for the key names while
            # loading a checkpoint into a model built under zero.Init. A meta tensor keeps the shape and
            # dtype and refuses any read of values (DeepSpeed hands out its empty placeholder instead).
            return torch.empty(args[0].shape, dtype=args[0].dtype, device="meta")
        partitioned = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, PartitionedParameter)]
        owners = [owner_of(p) for p in partitioned]
        for p, owner in zip(partitioned, owners):
            context = context_of(p)
            if owner is None or context is None or not context.gather_on_access(owner, owners):
                raise PartitionedParameterError(_message(p, owner, func))
        # Gathered on the spot (a module's forward, or init_context): plain Parameters again.
        return func(*args, **kwargs)


def _is_no_op(func, args, kwargs) -> bool:
    """`p.to(...)` changing nothing, or `p.data = p`: what Module.to does to a parameter already right."""
    if func == _Tensor.data.__set__:  # method-wrappers compare equal, never identical
        return args[1] is args[0]
    if func is not _Tensor.to or kwargs.get("copy", False):
        return False
    p = args[0]
    device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
    return ((device is None or torch.device(device) == p.device) and (dtype is None or dtype == p.dtype)
            and memory_format in (None, torch.preserve_format))


def _built_before_engine(param: torch.Tensor) -> bool:
    """A parameter built under init_context whose values no engine holds yet (init_context's record)."""
    return getattr(owner_of(param), "ctx", None) is not None


def _message(param: torch.Tensor, unit: Any, func) -> str:
    name = unit.name_of(param) if unit is not None else "<unregistered>"
    if getattr(unit, "ctx", None) is not None:  # created under init_context, not yet in an engine
        return (f"zerodp stage 3: a parameter of shape {tuple(param.shape)} was created under zerodp.init_context "
                f"and is partitioned across ranks until zerodp.initialize(model, ...) builds the engine; it was "
                f"read by {getattr(func, '__qualname__', func)} outside the init block. Build the engine first "
                f"(create the model on its final device and dtype inside the block), then read it through "
                f"`with zerodp.gathered_parameters([param]):`.")
    where = f" (gathered only during the forward/backward of {unit.module_name!r})" if unit is not None else ""
    what = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return (f"zerodp stage 3: parameter {name!r} of shape {tuple(param.shape)} is partitioned across ranks: this "
            f"rank stores only its 1/N shard, and the full value exists only while its unit is gathered{where}. "
            f"It was read by {what} outside any gather. Wrap the code in "
            f"`with zerodp.gathered_parameters([param]):` (a collective: every rank must enter it; pass "
            f"modifier_rank=r to write new values), or read it inside the model's forward.")


def set_partitioned(params: list[nn.Parameter], classes: Optional[list[type]]) -> None:
    """Switch parameters to `PartitionedParameter` (classes=None) or back to their own `classes`."""
    for i, p in enumerate(params):
        p.__class__ = PartitionedParameter if classes is None else classes[i]
