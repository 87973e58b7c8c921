"""What a checkpoint holds of an engine, and how a new layout finds its part of it (resharding).

Saving side: `describe_tensors` names every tensor of the model's state_dict (trainable, frozen or
buffer; tied aliases; true shapes even where a parameter is partitioned), and `shard_payload`
lists this rank's slices: for each segment of each sharded unit (see `partition.Segment`), the fp32
master and every elementwise optimizer state tensor, keyed by parameter name and element range.

Loading side: `assemble_master` builds one unit's new master shard and optimizer state by
intersecting each of its segments with the saved ones (`format.overlapping`), reading
only those slices. Padding elements stay zero. Non-elementwise state (Adam's `step`) is per master
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

from . import format as fmt
from ..errors import CheckpointError
from ..optim.larc import LARC
from ..optim.optimizer_list import OptimizerList
from ..seams import CheckpointEngine


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


# -- saving: this rank's slices, scalars, RNG ----------------------------------------------------


def shard_payload(engine: CheckpointEngine):
    """This rank's slices of every sharded unit, one entry per parameter segment (views, no copies):
    the fp32 master and elementwise optimizer state of trainable units, the values of frozen ones."""
    names = canonical_names(engine)
    tensors: dict[str, torch.Tensor] = {}
    segments, units = [], []
    for unit, master in sharded_units(engine):
        if (unit.layout.num_shards == 1 and engine.rank != 0) or engine.sharding.replica_index != 0:
            continue  # replicated on every rank (stage 0) or in every MiCS block: the first copy is enough
        st = engine.optimizer.state_of(master_index(engine, master)) if master is not None else {}
        sources = {fmt.MASTER: master} if master is not None else {fmt.FROZEN: unit.param_shard}
        elementwise = {k: v for k, v in st.items() if torch.is_tensor(v) and v.shape == master.shape}
        sources.update(sorted(elementwise.items()))
        scalars = {k: encode_scalar(k, v) for k, v in st.items() if k not in elementwise}
        index = len(units)
        units.append({"group": unit.group_index if master is not None else -1, "state_keys": sorted(elementwise),
                      "scalars": scalars})
        if master is not None and unit.layout.whole_tensors:
            units[-1]["param_state"] = _save_tensor_states(engine, unit, master, names, tensors)
        for seg in unit.layout.segments(unit.shard_index):
            name = names[id(unit.params[seg.param_index])]
            sl = slice(seg.shard_start, seg.shard_start + seg.numel)
            for kind, source in sources.items():
                tensors[fmt.tensor_key(kind, name, seg.param_start, seg.param_end)] = source.detach()[sl]
            segments.append((name, seg.param_start, seg.param_end, index))
    return tensors, segments, units


def _save_tensor_states(engine: CheckpointEngine, unit, master, names: dict, tensors: dict) -> dict:
    """Whole-tensor unit: put each owned parameter's state tensors into `tensors`; returns the
    unit entry's `param_state`: {name: {"tensors": [keys], "scalars": {key: encoded}}}."""
    out = {}
    for param_index, state in engine.optimizer.tensor_states_of(master_index(engine, master)).items():
        name = names[id(unit.params[param_index])]
        entry = out[name] = {"tensors": [], "scalars": {}}
        for key, value in sorted(state.items()):
            if torch.is_tensor(value):
                tensors[fmt.tensor_key(f"param_state.{key}", name, 0, 0)] = value.detach().contiguous()
                entry["tensors"].append(key)
            else:
                entry["scalars"][key] = encode_scalar(key, value)
    return out


def load_tensor_states(unit, names: dict, meta: dict, files: fmt.CheckpointFiles) -> dict[int, dict]:
    """Whole-tensor unit: the saved optimizer state of each parameter this rank owns now, keyed by
    its position in the unit's layout (empty where the checkpoint has none: saved before any step)."""
    out = {}
    for seg in unit.layout.segments(unit.shard_index):
        name = names[id(unit.params[seg.param_index])]
        saved = meta["segments"].get(name, [])
        entries = [(rank, meta["units"][rank][index].get("param_state")) for rank, _, _, index in saved]
        if any(entry is None for _, entry in entries):
            raise CheckpointError(f"{name}: the checkpoint keeps its optimizer state per element, but this "
                                  f"engine's optimizer reads whole tensors; use the optimizer it was saved with")
        owners = [(rank, entry[name]) for rank, entry in entries if name in entry]
        if not owners:
            continue  # no state yet (saved before the first step)
        rank, entry = owners[0]
        reader = files.tensors(fmt.shard_file(rank, meta["world_size"]))
        state = {k: reader.get_tensor(fmt.tensor_key(f"param_state.{k}", name, 0, 0)) for k in entry["tensors"]}
        state.update({k: decode_scalar(v, torch.device("cpu")) for k, v in entry["scalars"].items()})
        out[seg.param_index] = state
    return out


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


def assemble_master(unit, master: torch.Tensor, names: dict, meta: dict, files: fmt.CheckpointFiles,
                    scalar_device: torch.device) -> tuple[torch.Tensor, dict]:
    """This rank's new master shard and optimizer state for one unit, from the overlapping saved slices."""
    new_master = torch.zeros_like(master)  # padding stays zero
    tensors: dict[str, torch.Tensor] = {}
    state_keys, scalars = None, None
    for seg in unit.layout.segments(unit.shard_index):
        name = names[id(unit.params[seg.param_index])]
        for rank, start, end, index, lo, hi in fmt.overlapping(meta["segments"].get(name, []),
                                                               seg.param_start, seg.param_end):
            saved = meta["units"][rank][index]
            file = fmt.shard_file(rank, meta["world_size"])
            if state_keys is None:
                state_keys, scalars = saved["state_keys"], saved["scalars"]
            elif saved["state_keys"] != state_keys or saved["scalars"] != scalars:
                raise CheckpointError(
                    f"parameters saved in different optimizer states end up in one shard here (e.g. {name}: "
                    f"{saved['scalars']} vs {scalars}); zerodp can only merge state that agrees, as it does "
                    f"when a group's parameters step together")
            dst = slice(seg.shard_start + lo - seg.param_start, seg.shard_start + hi - seg.param_start)
            for key in [fmt.MASTER] + state_keys:
                piece = files.read_slice(file, fmt.tensor_key(key, name, start, end), lo - start, hi - start)
                if key == fmt.MASTER:
                    new_master[dst] = piece
                    continue
                if key not in tensors:
                    tensors[key] = torch.zeros(master.shape, dtype=piece.dtype, device=master.device)
                tensors[key][dst] = piece
    if state_keys is None:  # a shard of padding only: the state its group's other shards have
        saved = next((u for units in meta["units"] for u in units if u["group"] == unit.group_index), None)
        state_keys, scalars = (saved["state_keys"], saved["scalars"]) if saved else ([], {})
        tensors = {k: torch.zeros_like(master) for k in state_keys}
    state = dict(tensors)
    state.update({k: decode_scalar(v, scalar_device) for k, v in scalars.items()})
    return new_master, state


def assemble_frozen_shard(unit, names: dict, files: fmt.CheckpointFiles) -> torch.Tensor:
    """This rank's new shard of a frozen unit (stage 3), whether saved in segments or whole."""
    shard = torch.zeros_like(unit.param_shard)
    for seg in unit.layout.segments(unit.shard_index):
        name = names[id(unit.params[seg.param_index])]
        shard[seg.shard_start:seg.shard_start + seg.numel] = files.read_value(name, seg.param_start, seg.param_end)
    return shard
