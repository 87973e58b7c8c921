"""Building the inner optimizer: from DeepSpeed's `optimizer` section, and again on master shards.

zerodp never steps the user's optimizer object itself: it reads its class, defaults and per-group
hyper-parameters and builds the same optimizer over this rank's flat fp32 master shards. That is
exact only for optimizers whose update is elementwise (each element's new value depends on that
element alone), or that are shard-aware (LARC, LAMB: see `shard_norms`). Anything else is refused,
unless the user asserts it is elementwise with `zero_allow_untested_optimizer: true`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Union

import torch

from .deepspeed_types import build_deepspeed_type, check_no_auto
from .fused_adam import FusedAdam
from .fused_lamb import FusedLamb
from ..errors import OptimizerError
from .lamb import LAMB
from .larc import LARC

# Elementwise updates: exact on any flat layout. (Adafactor, LBFGS, SparseAdam, Muon are not.)
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
               torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
               torch.optim.Rprop, FusedAdam)
SHARD_AWARE = (LAMB, FusedLamb)

_BY_NAME = {cls.__name__.lower(): cls for cls in ELEMENTWISE + SHARD_AWARE}

OptimizerLike = Union[torch.optim.Optimizer, LARC]


def check_supported(optimizer: OptimizerLike, allow_untested: bool) -> None:
    """Raise OptimizerError unless `optimizer` stays exact on flat shards."""
    inner = optimizer.optim if isinstance(optimizer, LARC) else optimizer
    if type(inner) in ELEMENTWISE + SHARD_AWARE or allow_untested:
        return
    raise OptimizerError(
        f"{type(inner).__name__} is not known to be elementwise, so running it on flat shards could silently "
        f"change its update. Supported: {', '.join(c.__name__ for c in ELEMENTWISE + SHARD_AWARE)}, and "
        f"zerodp.optim.LARC around any of them. If its update really is per element, set "
        f"'zero_allow_untested_optimizer': true in the config.")


def build_from_section(section_type: str, params: dict, model_params) -> OptimizerLike:
    """Build an optimizer from DeepSpeed's `optimizer: {type, params}` (plus `larc: {...}` for LARC)."""
    params = dict(params)
    check_no_auto(section_type, params)
    larc = params.pop("larc", None)
    if larc is None:  # DeepSpeed's own types, with DeepSpeed's meaning (Adam is decoupled, Lamb is FusedLamb)
        built = build_deepspeed_type(section_type, params, model_params)
        if built is not None:
            return built
    params.pop("torch_adam", None)  # DeepSpeed's switch between its fused kernel and torch's Adam
    name = section_type.lower()
    if name == "larc":
        name, larc = "sgd", larc or {}
    cls = _BY_NAME.get(name)
    if cls is None:
        raise OptimizerError(f"optimizer type '{section_type}' is unknown; use one of "
                             f"{', '.join(sorted(_BY_NAME))} or LARC")
    try:
        opt = cls(model_params, **params)
    except TypeError as err:
        raise OptimizerError(f"optimizer {cls.__name__}: bad params {sorted(params)}: {err}") from None
    return LARC(opt, **larc) if larc is not None else opt


def group_hyperparameters(optimizer: OptimizerLike) -> list[dict[str, Any]]:
    """Each param group's settings without its parameters."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def rebuild(optimizer: OptimizerLike, param_groups: list[dict[str, Any]]) -> OptimizerLike:
    """The same optimizer (class, defaults, per-group settings, LARC wrapping) over new tensors."""
    if isinstance(optimizer, LARC):
        return LARC(rebuild(optimizer.optim, param_groups), **optimizer.settings)
    # Every group already carries its full settings; defaults only need to satisfy the constructor
    # (some classes keep defaults the constructor does not take, e.g. AdamW's decoupled_weight_decay).
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    rebuilt = type(optimizer)(param_groups, **defaults)
    for new, old in zip(rebuilt.param_groups, param_groups):
        new.update({k: v for k, v in old.items() if k != "params"})
    return rebuilt


def resolve_optimizer(optimizer: Union[OptimizerLike, Callable, None], section, model_params) -> OptimizerLike:
    """Turn the user's optimizer argument (instance, callable, or None with a config section) into one."""
    if optimizer is None:
        if section is None:
            raise OptimizerError("no optimizer: pass one to zerodp.initialize(model, optimizer, config) or add an "
                                 "'optimizer': {'type': ..., 'params': {...}} section to the config")
        return build_from_section(section.type, section.params, model_params)
    if section is not None:
        raise OptimizerError("an optimizer was passed and the config also has an 'optimizer' section; keep one")
    if isinstance(optimizer, (torch.optim.Optimizer, LARC)):
        if len(optimizer.state) and any(len(s) for s in optimizer.state.values()):
            raise OptimizerError("the optimizer already has state (it has stepped); pass a fresh optimizer, or "
                                 "restore state with engine.load_checkpoint")
        return optimizer
    if callable(optimizer):
        built = optimizer(model_params)
        if not isinstance(built, (torch.optim.Optimizer, LARC)):
            raise OptimizerError(f"the optimizer callable returned {type(built).__name__}, not an Optimizer")
        return built
    raise OptimizerError(f"optimizer must be a torch.optim.Optimizer, zerodp.optim.LARC or a callable, "
                         f"not {type(optimizer).__name__}")


def state_numel_per_param(optimizer: OptimizerLike) -> int:
    """Elements of per-element optimizer state the optimizer keeps (Adam: 2 moments; SGD+momentum: 1)."""
    inner = optimizer.optim if isinstance(optimizer, LARC) else optimizer
    d = inner.defaults
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW, FusedAdam, FusedLamb)):
        return 3 if d.get("amsgrad") else 2
    if isinstance(inner, torch.optim.SGD):
        return 1 if d.get("momentum", 0) else 0
    if isinstance(inner, torch.optim.RMSprop):
        return 1 + (d.get("momentum", 0) > 0) + bool(d.get("centered"))
    if isinstance(inner, (torch.optim.Adagrad, torch.optim.ASGD)):
        return 1
    if isinstance(inner, (torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                          torch.optim.Rprop, LAMB)):
        return 2
    raise OptimizerError(f"no state-size rule for {type(inner).__name__}")
