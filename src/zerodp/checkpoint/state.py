"""What a checkpoint holds of an engine, and how a new layout finds its part of it (resharding).

Saving side: `describe_tensors` names every tensor of the model's state_dict (trainable, frozen or
buffer; tied aliases; true shapes even where a parameter is partitioned), and a rank's shard file
holds its slices (`units.plan_save`): for each segment of each sharded unit (see
`partition.Segment`), the fp32 master and every elementwise optimizer state tensor, keyed by
parameter name and element range.

Loading side: `units.plan_load` finds one unit's new master shard and optimizer state by
intersecting each of its segments with the saved ones (`format.overlapping`), and `units.load_unit`
reads only those slices. Padding elements stay zero. Non-elementwise state (Adam's `step`) is per master
tensor: a new master takes the value of the saved units it overlaps, which must agree (they do
when a group's parameters step together), and a shard of padding only takes its group's value.

Whole-tensor units (flat/whole_tensor_layout.py: Muon, Adafactor) keep their optimizer state per
parameter, as torch does (Adafactor's row and column moments are neither elementwise nor scalar):
each rank saves its owned parameters' state tensors whole, under `tensor_key("param_state.<key>",
name, 0, 0)`, listed in its unit entry's `param_state`; a new owner reads them by parameter name,
so they reshard across world sizes and stages like the masters.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import torch
from torch import nn

from ..errors import CheckpointError
from ..optimizers.larc import LARC
from ..optimizers.optimizer_list import OptimizerList
from ..shard.seams import CheckpointEngine


# -- describing the model --------------------------------------------------------------------------


def describe_tensors(engine: CheckpointEngine) -> dict[str, dict]:
    """meta.json's `tensors`: one entry per key of the model's state_dict, in its order.

    Trainable shapes come from the units' layouts, which hold the true shapes even where a
    parameter is not resident (stage 3).
    """
    groups = {id(p): unit.group_index for unit in engine.units for p in unit.params}
    shapes = {id(p): list(shape) for unit, _ in sharded_units(engine)
              for p, shape in zip(unit.params, unit.layout.shapes)}
    first_key: dict[int, str] = {}
    out = {}
    for key, t in engine.module.state_dict(keep_vars=True).items():
        if not torch.is_tensor(t):
            continue  # a module's extra state (get_extra_state) is not saved
        alias_of = first_key.setdefault(id(t), key)
        entry = {"kind": "buffer", "shape": shapes.get(id(t), list(t.shape)), "dtype": dtype_name(t.dtype),
                 "alias_of": None if alias_of == key else alias_of, "group": groups.get(id(t))}
        if isinstance(t, nn.Parameter):
            entry["kind"] = "param" if id(t) in groups else "frozen"
        out[key] = entry
    return out


def sharded_units(engine: CheckpointEngine) -> list[tuple[Any, Optional[torch.Tensor]]]:
    """Every flat unit whose values are kept in shards, with its fp32 master: the optimizer's units,
    and (stage 3) the units of frozen parameters, which have no master (None)."""
    frozen = engine.sharding.frozen_units
    return list(zip(engine.units, engine.optimizer.masters)) + [(unit, None) for unit in frozen]


def canonical_names(engine: CheckpointEngine) -> dict[int, str]:
    """id(tensor) -> the first state_dict key naming it (the name used on disk)."""
    names: dict[int, str] = {}
    for key, t in engine.module.state_dict(keep_vars=True).items():
        if torch.is_tensor(t):
            names.setdefault(id(t), key)
    return names


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32 (also what `getattr(torch, name)` reads back)."""
    return str(dtype).removeprefix("torch.")


def optimizer_class(engine: CheckpointEngine) -> tuple[str, Optional[dict]]:
    """The inner optimizer's import path, and LARC's settings when LARC wraps it (else None)."""
    opt = engine.optimizer.optimizer
    if isinstance(opt, OptimizerList):  # its members, in order
        return "OptimizerList[" + ",".join(f"{type(o).__module__}.{type(o).__qualname__}"
                                           for o in opt.optimizers) + "]", None
    inner = opt.optim if isinstance(opt, LARC) else opt
    settings = opt.settings if isinstance(opt, LARC) else None
    return f"{type(inner).__module__}.{type(inner).__qualname__}", settings


def inner_groups(engine: CheckpointEngine) -> list[tuple[int, dict]]:
    """(user's group index, inner optimizer group) for each group zerodp's optimizer steps."""
    return list(zip(engine.optimizer.group_indices, engine.optimizer.param_groups))


def master_index(engine: CheckpointEngine, master: torch.Tensor) -> int:
    """Position of `master` among the optimizer's flat masters (one per trainable unit)."""
    return next(i for i, m in enumerate(engine.optimizer.masters) if m is master)


# -- saving: scalars, RNG ------------------------------------------------------------------------


def encode_scalar(key: str, value: Any) -> dict:
    """JSON for a non-elementwise optimizer state value (a 0-dim tensor or a Python number)."""
    if torch.is_tensor(value) and value.dim() == 0:
        return {"type": "tensor", "dtype": dtype_name(value.dtype), "value": value.item()}
    if isinstance(value, (bool, int, float)):
        return {"type": type(value).__name__, "value": value}
    shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
    raise CheckpointError(f"optimizer state {key!r} ({shape}) is neither per-element nor a scalar; zerodp "
                          f"cannot save or reshard it")


def decode_scalar(entry: dict, device: torch.device):
    """The value `encode_scalar` described, a 0-dim tensor placed on `device` where it was a tensor."""
    if entry["type"] == "tensor":
        return torch.tensor(entry["value"], dtype=getattr(torch, entry["dtype"]), device=device)
    return {"bool": bool, "int": int, "float": float}[entry["type"]](entry["value"])


def scalar_state_device(engine: CheckpointEngine, master: torch.Tensor) -> torch.device:
    """Where torch keeps a scalar state tensor such as `step` for `master` (the optimizer knows)."""
    return engine.optimizer.scalar_state_device(master_index(engine, master))


def model_states(engine: CheckpointEngine) -> dict[str, torch.Tensor]:
    """Frozen parameters and buffers that every rank holds whole, under their first names (rank 0)."""
    entries = describe_tensors(engine)
    sharded = {id(p) for unit, _ in sharded_units(engine) for p in unit.params}
    return {k: t.detach() for k, t in engine.module.state_dict(keep_vars=True).items()
            if k in entries and entries[k]["alias_of"] is None and id(t) not in sharded}


def rng_state() -> dict:
    """This process's RNG states as JSON: torch CPU, python, numpy (if installed), CUDA (if in use)."""
    state = {"torch": torch.get_rng_state().tolist(), "python": _jsonable(random.getstate())}
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        state["numpy"] = _jsonable(np.random.get_state())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def _jsonable(obj):
    if isinstance(obj, (tuple, list)):
        return [_jsonable(o) for o in obj]
    return obj.tolist() if hasattr(obj, "tolist") else obj


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned (CUDA states for the devices this process has)."""
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            np = None
        if np is not None:
            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        saved = [torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]]
        for device in range(min(len(saved), torch.cuda.device_count())):
            torch.cuda.set_rng_state(saved[device], device)


def encode_hyper(group: dict) -> dict:
    """A param group's JSON-representable hyper-parameters (tuples tagged; others, like tensors, left out)."""
    out = {}
    for k, v in group.items():
        if k == "params":
            continue
        if isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v):
            out[k] = {"tuple": list(v)}
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
    return out


def decode_hyper(value):
    """The inverse of `encode_hyper` for one value."""
    return tuple(value["tuple"]) if isinstance(value, dict) and "tuple" in value else value


# -- loading: the new layout's slices ----------------------------------------------------------------


def check_same_model(saved: dict, current: dict, where) -> None:
    """Raise CheckpointError listing every name, shape or role that differs between checkpoint and model."""
    problems = []

    def report(title: str, items: list[str]) -> None:
        if items:
            more = f" ... and {len(items) - 10} more" if len(items) > 10 else ""
            problems.append(f"{title}: {', '.join(items[:10])}{more}")

    report("in the model but not in the checkpoint", [k for k in current if k not in saved])
    report("in the checkpoint but not in the model", [k for k in saved if k not in current])
    both = [k for k in current if k in saved]
    report("shapes differ (checkpoint vs model)", [f"{k} {tuple(saved[k]['shape'])} vs {tuple(current[k]['shape'])}"
                                                   for k in both if saved[k]["shape"] != current[k]["shape"]])
    report("role differs (checkpoint vs model)", [f"{k} {saved[k]['kind']} vs {current[k]['kind']}"
                                                  for k in both if saved[k]["kind"] != current[k]["kind"]])
    report("tying differs (checkpoint vs model)", [f"{k} tied to {saved[k]['alias_of']} vs {current[k]['alias_of']}"
                                                   for k in both if saved[k]["alias_of"] != current[k]["alias_of"]])
    report("optimizer group differs (checkpoint vs model)", [f"{k} {saved[k]['group']} vs {current[k]['group']}"
                                                             for k in both if saved[k]["group"] != current[k]["group"]])
    if problems:
        raise CheckpointError(f"checkpoint {where} does not match this model:\n  " + "\n  ".join(problems))
