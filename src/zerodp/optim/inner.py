"""Building the inner optimizer: from DeepSpeed's `optimizer` section, and again on master shards.

zerodp never steps the user's optimizer object itself: it reads its class, defaults and per-group
hyper-parameters and builds the same optimizer over this rank's flat fp32 master shards. That is
exact only for optimizers whose update is elementwise (each element's new value depends on that
element alone), that are shard-aware (LARC, LAMB: see `shard_norms`), or that read whole tensors
(Muon, Adafactor, and any class passed to `register_whole_tensor`): their param groups are laid
out so that each rank owns whole tensors (flat/whole_tensor_layout.py) and the rebuilt optimizer
steps views shaped like the parameters. Anything else is refused, unless the user asserts it is
elementwise with `zero_allow_untested_optimizer: true`.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Union

import torch

from ..optimizers.deepspeed_types import build_deepspeed_type, check_no_auto
from ..optimizers.fused_adam import FusedAdam
from ..optimizers.fused_lamb import FusedLamb
from ..errors import OptimizerError
from ..optimizers.lamb import LAMB
from ..optimizers.larc import LARC
from ..optimizers.lion import Lion
from ..optimizers.optimizer_list import OptimizerList

# Elementwise updates: exact on any flat layout. (Adafactor, LBFGS, SparseAdam, Muon are not.)
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
               torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
               torch.optim.Rprop, FusedAdam, Lion)
SHARD_AWARE = (LAMB, FusedLamb)

# Updates that read a whole tensor (a matrix's orthogonalisation, row/column statistics, its RMS):
# exact when each rank owns whole tensors. Extended by `register_whole_tensor`.
_WHOLE_TENSOR: list[type] = [torch.optim.Muon, torch.optim.Adafactor]

_BY_NAME = {cls.__name__.lower(): cls for cls in ELEMENTWISE + SHARD_AWARE + tuple(_WHOLE_TENSOR)}

OptimizerLike = Union[torch.optim.Optimizer, LARC, OptimizerList]


def register_whole_tensor(optimizer_class: type) -> type:
    """Declare that `optimizer_class` updates each parameter from that whole tensor alone (Shampoo-style
    preconditioners, per-matrix orthogonalisation, factored statistics): zerodp then gives each rank
    whole tensors of the groups it steps, so the update is exact at every stage. Usable as a decorator.

    The class must step each parameter independently of the others (its state keyed by parameter,
    as every torch.optim optimizer does); an update that mixes parameters is not made exact by this.
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise OptimizerError(f"register_whole_tensor takes a torch.optim.Optimizer subclass, not {optimizer_class!r}")
    if optimizer_class not in _WHOLE_TENSOR:
        _WHOLE_TENSOR.append(optimizer_class)
    _BY_NAME.setdefault(optimizer_class.__name__.lower(), optimizer_class)  # the config's optimizer.type may name it
    return optimizer_class


def needs_whole_tensors(optimizer) -> bool:
    """True for an optimizer (a member of an OptimizerList, not the list) that reads whole tensors."""
    return type(optimizer) in _WHOLE_TENSOR


def members(optimizer: OptimizerLike) -> list:
    """The optimizer of each user param group (the same object for every group of one optimizer)."""
    if isinstance(optimizer, OptimizerList):
        return optimizer.member_of_group()
    return [optimizer] * len(optimizer.param_groups)


def check_supported(optimizer: OptimizerLike, allow_untested: bool) -> None:
    """Raise OptimizerError unless `optimizer` stays exact on zerodp's shards."""
    if isinstance(optimizer, OptimizerList):
        for member in optimizer.optimizers:
            if isinstance(member, LARC) or type(member) in SHARD_AWARE:
                # their whole-parameter norms are bound to one optimizer's shards (shard_norms.maybe_bind)
                raise OptimizerError(f"{type(member).__name__} cannot be one of several optimizers yet; pass it "
                                     f"alone, or use an elementwise optimizer beside Muon")
            check_supported(member, allow_untested)
        return
    inner = optimizer.optim if isinstance(optimizer, LARC) else optimizer
    if isinstance(optimizer, LARC) and needs_whole_tensors(inner):
        raise OptimizerError(f"LARC around {type(inner).__name__} is not supported; use {type(inner).__name__} alone")
    if type(inner) in ELEMENTWISE + SHARD_AWARE or needs_whole_tensors(inner) or allow_untested:
        return
    raise OptimizerError(
        f"{type(inner).__name__} is not known to be elementwise, so running it on flat shards could silently "
        f"change its update. Supported: {', '.join(c.__name__ for c in ELEMENTWISE + SHARD_AWARE)}, "
        f"zerodp.optim.LARC around any of them, and whole-tensor optimizers "
        f"({', '.join(c.__name__ for c in _WHOLE_TENSOR)}). If each parameter's update reads only that whole "
        f"tensor (e.g. Shampoo), call zerodp.optim.register_whole_tensor({type(inner).__name__}) before "
        f"zerodp.initialize; if its update really is per element, set 'zero_allow_untested_optimizer': true "
        f"in the config.")


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


def rebuild_kept(optimizer: OptimizerLike, groups: list[dict[str, Any]], kept: list[int]) -> OptimizerLike:
    """`rebuild` over the user groups `kept` (indices into `groups`, one per user group); an
    OptimizerList is rebuilt member by member, each over its own kept groups."""
    if not isinstance(optimizer, OptimizerList):
        return rebuild(optimizer, [groups[i] for i in kept])
    owner = optimizer.member_of_group()
    rebuilt = []
    for member in optimizer.optimizers:
        mine = [groups[i] for i in kept if owner[i] is member]
        if mine:  # a member whose parameters are all frozen steps nothing
            rebuilt.append(rebuild(member, mine))
    return OptimizerList(rebuilt)


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


def build_from_sections(sections, model) -> OptimizerLike:
    """The config's `optimizer` section, or list of sections each with its `select` (optim/selection.py)."""
    from ..optimizers.selection import select_parameters

    sections = sections if isinstance(sections, list) else [sections]
    chosen = select_parameters(sections, model)
    built = [build_from_section(s.type, s.params, params) for s, params in zip(sections, chosen)]
    for k, member in enumerate(built):
        if not isinstance(member, torch.optim.Optimizer):
            raise OptimizerError(f"optimizer section {k} ({sections[k].type}) builds a {type(member).__name__}, which "
                                 f"cannot be one of several optimizers; use it as the only section")
    return built[0] if len(built) == 1 else OptimizerList(built)


def resolve_optimizer(optimizer: Union[OptimizerLike, Callable, None], section, model_params,
                      model=None) -> OptimizerLike:
    """Turn the user's optimizer argument (instance, callable, or None with a config section) into one.
    A list of sections, or a section with `select`, needs `model` (its parameter names and modules)."""
    if optimizer is None:
        if section is None:
            raise OptimizerError("no optimizer: pass one to zerodp.initialize(model, optimizer, config) or add an "
                                 "'optimizer': {'type': ..., 'params': {...}} section to the config")
        if isinstance(section, list) or section.select is not None:
            if model is None:
                raise OptimizerError("optimizer sections with 'select' need the model to choose parameters from")
            return build_from_sections(section, model)
        return build_from_section(section.type, section.params, model_params)
    if section is not None:
        raise OptimizerError("an optimizer was passed and the config also has an 'optimizer' section; keep one")
    if isinstance(optimizer, (list, tuple)):  # several optimizers over disjoint parameters (Muon + AdamW)
        for k, member in enumerate(optimizer):
            if not isinstance(member, torch.optim.Optimizer):
                raise OptimizerError(f"optimizer {k} of the list is a {type(member).__name__}, not a torch.optim."
                                     f"Optimizer; pass built optimizers, e.g. [Muon(matrices), AdamW(rest)]")
            resolve_optimizer(member, None, model_params)  # the same checks as one optimizer
        return OptimizerList(optimizer)
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


def whole_tensor_state_numel(optimizer, shape) -> int:
    """Optimizer state elements a whole-tensor optimizer keeps for one parameter of `shape`
    (Muon: the momentum; Adafactor: row and column moments of a matrix, a full moment of a vector;
    a registered class: assumed one per element)."""
    numel = math.prod(shape)
    if isinstance(optimizer, torch.optim.Adafactor) and len(shape) >= 2:
        batch = math.prod(shape[:-2])
        return batch * (shape[-2] + shape[-1])
    return numel


def streamed_state_names(optimizer, shape) -> tuple[str, ...]:
    """Names of the state tensors one optimizer (not a list) keeps shaped like a parameter (or chunk) of
    `shape`: what offload_optimizer streams (offload/optimizer_state.py); other state stays resident.
    Classes without a known naming get one placeholder name per state element."""
    inner = optimizer.optim if isinstance(optimizer, LARC) else optimizer
    if isinstance(inner, torch.optim.Adafactor):  # factored row/column moments for matrices: not streamed
        return ("variance",) if len(shape) < 2 else ()
    if isinstance(inner, (torch.optim.Muon, torch.optim.SGD)):
        return ("momentum_buffer",) if isinstance(inner, torch.optim.Muon) or inner.defaults.get("momentum") else ()
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW, FusedAdam, FusedLamb)):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if inner.defaults.get("amsgrad") else ())
    if isinstance(inner, Lion):
        return ("exp_avg",)
    return tuple(f"{type(inner).__name__}.{i}" for i in range(state_numel_per_param(inner)))


def state_numel_per_param(optimizer: OptimizerLike) -> int:
    """Elements of per-element optimizer state the optimizer keeps (Adam: 2 moments; SGD+momentum: 1)."""
    if isinstance(optimizer, OptimizerList):  # an upper bound over its members
        return max(state_numel_per_param(m) for m in optimizer.optimizers)
    inner = optimizer.optim if isinstance(optimizer, LARC) else optimizer
    d = inner.defaults
    if needs_whole_tensors(inner):  # Muon's momentum; an upper bound for Adafactor (whole_tensor_state_numel)
        return 1
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW, FusedAdam, FusedLamb)):
        return 3 if d.get("amsgrad") else 2
    if isinstance(inner, torch.optim.SGD):
        return 1 if d.get("momentum", 0) else 0
    if isinstance(inner, torch.optim.RMSprop):
        return 1 + (d.get("momentum", 0) > 0) + bool(d.get("centered"))
    if isinstance(inner, (torch.optim.Adagrad, torch.optim.ASGD, Lion)):
        return 1
    if isinstance(inner, (torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                          torch.optim.Rprop, LAMB)):
        return 2
    raise OptimizerError(f"no state-size rule for {type(inner).__name__}")
