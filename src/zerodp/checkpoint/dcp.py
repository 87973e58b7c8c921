"""torch distributed checkpoint (DCP) export and import, in the layout FSDP2 and torchtitan use.

A DCP folder written by `save_dcp` is what FSDP2 writes with
`dcp.save({"model": model_sd, "optimizer": optim_sd})` from `torch.distributed.checkpoint.state_dict.
get_state_dict(model, optimizer)`; `read_dcp` reads such a folder (written by FSDP2 at any world size, by
torchtitan, or by `save_dcp`) into a live engine at any world size and stage. The keys (DCP flattens nested
dicts with "."):

    model.<fqn>                           every model.state_dict() tensor: fp32 masters of trainable
                                          parameters, frozen parameters and buffers ("<fqn>" alone with
                                          model_key="", torchtitan's flattened model)
    optimizer.state.<fqn>.<key>           each trainable parameter's optimizer state: Adam's exp_avg and
                                          exp_avg_sq shaped like the parameter, `step` a 0-dim tensor
                                          (its own count: optim/step_counts.py)
    optimizer.param_groups.<i>.<hyper>    group i's hyper-parameters and `params` (fqns): get_state_dict's form
    optimizer.param_groups.<fqn>.<hyper>  the same per parameter: flatten_optimizer_state_dict=True's form
                                          (torchtitan); both are written, either is read
    zerodp_state.counters, .lr_scheduler  zerodp's step counters, loss scaler and schedule (JSON, torch.save
                                          bytes); other readers ignore them

[Note: DCP boxes] Each rank writes only what it owns: the elements of each parameter in its shard, as the
boxes `dcp_boxes.flat_range_boxes` cuts them into, each a view of the shard (no gather, no copy of the model);
rank 0 adds the small entries (steps, groups, whole buffers). On load each rank asks DCP for the boxes of its
new shard, and DCP's resharding reads them from whatever chunks were saved (FSDP2's row blocks at another world
size, zerodp's ranges). Held beyond training: a copy of this rank's masters and optimizer state (`state_of`
returns copies) while writing, and one buffer per loaded master and state tensor while reading.

Loading checks first (every rank, the same answer, agreed before anything else): the folder is a DCP
checkpoint; every model key and, unless `load_optimizer=False`, every optimizer state key this engine's
optimizer keeps (learnt by stepping a throwaway copy of it once) is there with the right shape; a missing key
is named with the fix. DCP fills this module's own buffers; the engine changes only after the read succeeded.
A trainable parameter with no optimizer state at all is one torch never stepped (it never had a gradient):
its moments stay zero and its step 0, as in torch.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from . import state as cs
from .. import comm
from ..errors import CheckpointError
from ..optim.inner import members, rebuild
from ..shard.seams import CheckpointEngine
from .dcp_boxes import BoxLoadPlanner, BoxSavePlanner, BoxTensor, flat_range_boxes

MODEL_KEY = "model"
STATE_PREFIX = "optimizer.state."
GROUPS_PREFIX = "optimizer.param_groups."
COUNTERS_KEY = "zerodp_state.counters"
SCHEDULE_KEY = "zerodp_state.lr_scheduler"
TRAIN_STEP_KEY = "train_state.step"   # torchtitan's TrainState step
# group entries that say how torch computes, not what: never copied from another writer's groups
_IMPLEMENTATION_OPTIONS = {"params", "foreach", "fused", "capturable", "differentiable"}


def model_entry(model_key: str, name: str) -> str:
    return f"{model_key}.{name}" if model_key else name


def state_entry(name: str, key: str) -> str:
    return f"{STATE_PREFIX}{name}.{key}"


# -- what the engine's optimizer keeps -----------------------------------------------------------------


class StateSpec(NamedTuple):
    """One optimizer group's per-parameter state: elementwise keys (dtype) and scalar keys (a template value)."""

    elementwise: dict[str, torch.dtype]
    scalars: dict[str, Any]


def _state_specs(engine: CheckpointEngine) -> dict[int, StateSpec]:
    """{user group index: StateSpec} for every group zerodp steps, learnt by stepping a copy of the group's
    optimizer once over a throwaway two-element tensor with a zero gradient and lr 0 (its state's keys and
    kinds; nothing of the engine is touched). Works for any elementwise torch optimizer."""
    out = {}
    inner = engine.optimizer.optimizer
    for position, (user, group) in enumerate(cs.inner_groups(engine)):
        options = {k: v for k, v in group.items() if k != "params"}
        if "lr" in options:
            options["lr"] = torch.zeros_like(options["lr"]) if torch.is_tensor(options["lr"]) else 0.0
        device = engine.optimizer.masters[0].device if engine.optimizer.masters else torch.device("cpu")
        probe = torch.zeros(2, device=device, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        throwaway = rebuild(members(inner)[position], [dict(options, params=[probe])])
        throwaway.step()
        state = throwaway.state.get(probe, {})
        out[user] = StateSpec({k: v.dtype for k, v in state.items() if torch.is_tensor(v) and v.shape == probe.shape},
                              {k: v for k, v in state.items() if not (torch.is_tensor(v) and v.shape == probe.shape)})
    return out


def _scalar_value(template: Any, value: float, device: Optional[torch.device] = None) -> Any:
    """`value` as the kind of scalar torch keeps (a 0-dim tensor of the template's dtype, or a Python number)."""
    if torch.is_tensor(template):
        return torch.tensor(value, dtype=template.dtype, device=device if device is not None else "cpu")
    return type(template)(value)


def _check_supported(engine: CheckpointEngine) -> None:
    if any(unit.layout.whole_tensors for unit in engine.units):
        raise CheckpointError("DCP export and import cover elementwise optimizers (Adam, AdamW, SGD, ...); this "
                              "engine keeps whole-tensor optimizer state (Muon, Adafactor): use save_checkpoint")


# -- saving ------------------------------------------------------------------------------------------


def save_dcp(engine: CheckpointEngine, path, model_key: str = MODEL_KEY) -> str:
    """Write the engine's model and optimizer state as a DCP checkpoint in folder `path` (every rank calls it;
    each writes its own shard). `model_key=""` puts the model's keys at the top level (torchtitan)."""
    if not engine.at_step_boundary:
        raise CheckpointError(f"save_dcp was called in the middle of gradient accumulation (micro step "
                              f"{engine.micro_step}); call it after the engine.step() that completes an optimizer step")
    _check_supported(engine)
    names = cs.canonical_names(engine)
    tensors = cs.describe_tensors(engine)
    aliases = {n: [k for k, e in tensors.items() if e["alias_of"] == n] for n in tensors}
    specs = _state_specs(engine)
    steps = engine.optimizer.param_steps()
    boxes: dict[str, tuple[tuple[int, ...], list[BoxTensor]]] = {}
    plain: dict[str, Any] = {}
    for unit, master in cs.sharded_units(engine):
        if (unit.layout.num_shards == 1 and engine.rank != 0) or engine.sharding.replica_index != 0:
            continue  # replicated (stage 0) or in every MiCS block: the first copy is written
        values, scalars = _unit_values(engine, unit, master, specs)
        for seg in unit.layout.segments(unit.shard_index):
            param = unit.params[seg.param_index]
            name, shape = names[id(param)], tuple(unit.layout.shapes[seg.param_index])
            for box in flat_range_boxes(shape, seg.param_start, seg.param_end):
                lo = seg.shard_start + box.lo - seg.param_start
                for kind, flat in values.items():
                    view = flat[lo:lo + box.hi - box.lo].view(box.sizes)
                    keys = [model_entry(model_key, n) for n in [name] + aliases[name]] if kind is None \
                        else [state_entry(name, kind)]
                    for key in keys:
                        boxes.setdefault(key, (shape, []))[1].append(BoxTensor(box.offsets, view))
            for key, (template, chunk_value) in scalars.items():
                # each parameter's own Adam step (optim/step_counts.py), else its chunk's value
                value = steps[id(param)] if key == "step" and id(param) in steps else chunk_value
                plain[state_entry(name, key)] = _scalar_value(template, value)
    if engine.rank == 0:
        plain.update(_rank0_entries(engine, tensors, aliases, model_key))
    path = Path(path)
    dcp.save(plain, storage_writer=dcp.FileSystemWriter(path), planner=BoxSavePlanner(boxes),
             process_group=engine.process_group, no_dist=not dist.is_initialized())
    return str(path)


def _unit_values(engine: CheckpointEngine, unit, master, specs: dict[int, StateSpec]):
    """({None: master (or a frozen unit's shard), state key: tensor}, {scalar key: (template, chunk value)}),
    copies of one unit's shard: a unit that never stepped has zero moments and step 0, as torch's would."""
    with unit.resident():  # offload_param: this unit's shard in memory while it is copied
        if master is None:
            return {None: unit.param_shard.detach().clone()}, {}
        spec = specs[unit.group_index]
        state = engine.optimizer.state_of(cs.master_index(engine, master))  # copies
        values = {None: master.detach().clone()}
        for key, dtype in spec.elementwise.items():
            values[key] = state[key] if key in state else torch.zeros(master.shape, dtype=dtype)
        scalars = {}
        for key, template in spec.scalars.items():
            saved = state.get(key)
            unset = 0.0 if key == "step" else float(template)
            scalars[key] = (template, float(saved) if saved is not None else unset)
    return values, scalars


def _rank0_entries(engine: CheckpointEngine, tensors: dict, aliases: dict, model_key: str) -> dict[str, Any]:
    """Whole buffers and frozen parameters, the param groups in both of torch's forms, zerodp's counters."""
    out: dict[str, Any] = {}
    for key, value in cs.model_states(engine).items():
        for name in [key] + aliases[key]:
            out[model_entry(model_key, name)] = value
    for user, params, hyper in _user_groups(engine, tensors):
        for k, v in hyper.items():
            out[f"{GROUPS_PREFIX}{user}.{k}"] = v
            for name in params:
                out[f"{GROUPS_PREFIX}{name}.{k}"] = v
        out[f"{GROUPS_PREFIX}{user}.params"] = params
    out[COUNTERS_KEY] = json.dumps({
        "global_step": engine.global_step, "micro_step": engine.micro_step, "skipped_steps": engine.skipped_steps,
        "gradient_accumulation_steps": engine.gradient_accumulation_steps, "loss_scaler": engine.scaler.state_dict()})
    if engine.lr_scheduler is not None:
        buffer = io.BytesIO()
        torch.save(engine.lr_scheduler.state_dict(), buffer)
        out[SCHEDULE_KEY] = buffer.getvalue()
    return out


def _user_groups(engine: CheckpointEngine, tensors: dict) -> list[tuple[int, list[str], dict]]:
    """(user group index, parameter names, hyper-parameters) of each group zerodp steps, as torch's get_state_dict
    lists them: with the frozen parameters the user put in a group where the engine knows them
    (`param_group_names`, read from the optimizer passed in), the settings zerodp steps with (a schedule's
    current lr)."""
    names = getattr(engine, "param_group_names", None)
    out = []
    for user, group in cs.inner_groups(engine):
        params = names[user] if names is not None and user < len(names) else \
            [n for n, e in tensors.items() if e["kind"] == "param" and e["group"] == user and not e["alias_of"]]
        out.append((user, params, {k: v for k, v in group.items() if k != "params"}))
    return out


# -- loading -----------------------------------------------------------------------------------------


class DcpResumed(NamedTuple):
    """What `read_dcp` read for the engine to apply itself (`ZeroEngine.load_dcp`)."""

    counters: Optional[dict]       # zerodp's counters and loss scaler (None: another writer's checkpoint)
    lr_scheduler: Optional[dict]   # zerodp's schedule state (None: none saved, or not asked for)
    train_step: Optional[int]      # torchtitan's train_state.step, when there is one
    optimizer_step: int            # the largest Adam step of any parameter (0 without optimizer state)


class _UnitRead(NamedTuple):
    unit: Any
    master: Optional[torch.Tensor]
    values: dict                   # None: the master (or frozen shard); state key: its buffer
    names: list[str]               # the unit's parameters, by canonical name


class _Plan(NamedTuple):
    reader: Any
    boxes: dict[str, list[BoxTensor]]
    plain: dict[str, Any]
    units: list[_UnitRead]
    specs: dict[int, StateSpec]
    stepped: set[str]              # trainable parameters with optimizer state in the checkpoint
    whole: dict[str, str]          # plain key -> the model's buffer or frozen parameter it fills (held whole)
    load_optimizer: bool


def read_dcp(engine: CheckpointEngine, path, load_optimizer: bool = True, model_key: Optional[str] = None,
             load_lr_scheduler: bool = True) -> DcpResumed:
    """Read DCP checkpoint `path` into the engine's units, module and optimizer groups (every rank calls it);
    returns what the engine applies itself. `model_key`: the prefix of the model's keys (None: "model", else
    top level, whichever the folder holds). Call `engine.load_dcp`, which does both."""
    plan, error = None, None
    try:
        _check_supported(engine)
        plan = _plan_load(engine, Path(path), load_optimizer, model_key, load_lr_scheduler)
    except Exception as err:  # agreed on below: every rank raises, none waits in dcp.load
        error = err
    _agree(engine, error, f"could not load the DCP checkpoint {path}")
    dcp.load(plan.plain, storage_reader=plan.reader, planner=BoxLoadPlanner(plan.boxes),
             process_group=engine.process_group, no_dist=not dist.is_initialized())
    try:
        steps = _read_steps(plan)
        groups = _saved_groups(engine, plan) if load_optimizer else {}
    except Exception as err:
        error = err
    _agree(engine, error, f"could not load the DCP checkpoint {path}")
    _apply(engine, plan, steps, groups)
    counters = json.loads(plan.plain[COUNTERS_KEY]) if COUNTERS_KEY in plan.plain else None
    schedule = torch.load(io.BytesIO(plan.plain[SCHEDULE_KEY]), weights_only=False) \
        if SCHEDULE_KEY in plan.plain else None
    train_step = int(plan.plain[TRAIN_STEP_KEY]) if TRAIN_STEP_KEY in plan.plain else None
    return DcpResumed(counters, schedule, train_step, max(steps.values(), default=0))


def _agree(engine: CheckpointEngine, error: Optional[Exception], what: str) -> None:
    """Raise on every rank if any rank failed (note: a collective)."""
    message = None if error is None else (str(error) if isinstance(error, CheckpointError)
                                          else f"{type(error).__name__}: {error}")
    messages = comm.all_gather_object(message, engine.process_group)
    if isinstance(error, CheckpointError):
        raise error
    if error is not None:
        raise CheckpointError(f"{what}: {message}") from error
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        raise CheckpointError(f"rank {failed[0][0]} {what}: {failed[0][1]}")


def _plan_load(engine: CheckpointEngine, path: Path, load_optimizer: bool, model_key: Optional[str],
               load_lr_scheduler: bool) -> _Plan:
    reader = dcp.FileSystemReader(path)
    try:
        saved = reader.read_metadata().state_dict_metadata
    except Exception as err:
        raise CheckpointError(f"{path} is not a torch distributed checkpoint (its .metadata file cannot be read: "
                              f"{type(err).__name__}: {err}); pass the folder given to dcp.save or save_dcp") from err
    names = cs.canonical_names(engine)
    tensors = cs.describe_tensors(engine)
    own = [n for n, e in tensors.items() if not e["alias_of"]]
    if model_key is None:
        model_key = MODEL_KEY if any(model_entry(MODEL_KEY, n) in saved for n in own) else ""
    specs = _state_specs(engine) if load_optimizer else {}
    trainable = {n: e["group"] for n, e in tensors.items() if e["kind"] == "param" and not e["alias_of"]}
    missing, problems = [], []
    for name in own:
        key = model_entry(model_key, name)
        if key not in saved:
            missing.append(key)
        elif not hasattr(saved[key], "size") or list(saved[key].size) != list(tensors[name]["shape"]):
            problems.append(f"{key}: saved {tuple(getattr(saved[key], 'size', ()))} but the model's is "
                            f"{tuple(tensors[name]['shape'])}")
    stepped = set()
    if load_optimizer:
        if not any(k.startswith(STATE_PREFIX) or k.startswith(GROUPS_PREFIX) for k in saved):
            raise CheckpointError(f"DCP checkpoint {path} holds no optimizer state (no '{STATE_PREFIX}*' or "
                                  f"'{GROUPS_PREFIX}*' keys): save it as dcp.save({{'model': ..., 'optimizer': ...}}) "
                                  f"from get_state_dict(model, optimizer), or load the weights only with "
                                  f"load_dcp(path, load_optimizer=False)")
        for name, user in trainable.items():
            spec = specs[user]
            wanted = list(spec.elementwise) + list(spec.scalars)
            present = [k for k in wanted if state_entry(name, k) in saved]
            prefix = state_entry(name, "")
            extra = [k for k in saved if k.startswith(prefix) and k[len(prefix):] not in wanted]
            if extra:
                problems.append(f"{', '.join(extra)}: optimizer state this engine's optimizer does not keep (use the "
                                f"optimizer class and options the checkpoint was saved with)")
            if present:
                stepped.add(name)
                missing += [state_entry(name, k) for k in wanted if k not in present]
                problems += [f"{state_entry(name, k)}: saved {tuple(saved[state_entry(name, k)].size)} but the "
                             f"parameter's shape is {tuple(tensors[name]['shape'])}"
                             for k in spec.elementwise if k in present
                             and list(saved[state_entry(name, k)].size) != list(tensors[name]["shape"])]
    if missing:
        shown = ", ".join(missing[:10]) + (f" ... and {len(missing) - 10} more" if len(missing) > 10 else "")
        model_missing = any(not k.startswith("optimizer.") for k in missing)
        fix = (f"the model's keys are looked up under '{model_key + '.' if model_key else '(top level)'}'; pass "
               f"model_key= the prefix the checkpoint used (\"model\" for dcp.save({{'model': ...}}), \"\" for "
               f"torchtitan's flattened model), and load a checkpoint of this model") if model_missing else \
            ("save every trainable parameter's optimizer state (get_state_dict(model, optimizer) after a step), or "
             "load the weights only with load_dcp(path, load_optimizer=False)")
        problems.insert(0, f"missing keys ({len(missing)}): {shown}; fix: {fix}")
    if problems:
        raise CheckpointError(f"DCP checkpoint {path} lacks what zerodp needs:\n  " + "\n  ".join(problems))

    boxes: dict[str, list[BoxTensor]] = {}
    units = []
    for unit, master in cs.sharded_units(engine):
        target = master if master is not None else unit.param_shard
        values = {None: torch.zeros(target.shape, dtype=target.dtype, device=target.device)}
        unit_names = [names[id(p)] for p in unit.params]
        if master is not None and load_optimizer and stepped.intersection(unit_names):
            for key, dtype in specs[unit.group_index].elementwise.items():
                values[key] = torch.zeros(master.shape, dtype=dtype, device=master.device)
        for seg in unit.layout.segments(unit.shard_index):
            name = names[id(unit.params[seg.param_index])]
            shape = tuple(unit.layout.shapes[seg.param_index])
            for box in flat_range_boxes(shape, seg.param_start, seg.param_end):
                lo = seg.shard_start + box.lo - seg.param_start
                for kind, flat in values.items():
                    if kind is not None and name not in stepped:
                        continue  # never stepped: its moments stay zero, as torch's would
                    key = model_entry(model_key, name) if kind is None else state_entry(name, kind)
                    view = flat[lo:lo + box.hi - box.lo].view(box.sizes)
                    boxes.setdefault(key, []).append(BoxTensor(box.offsets, view))
        units.append(_UnitRead(unit, master, values, unit_names))

    plain: dict[str, Any] = {}
    whole = {}
    sharded = {id(p) for unit, _ in cs.sharded_units(engine) for p in unit.params}
    live = engine.module.state_dict(keep_vars=True)
    for name in own:  # buffers and frozen parameters held whole (stages 0-2)
        if id(live[name]) not in sharded:
            whole[model_entry(model_key, name)] = name
            plain[model_entry(model_key, name)] = torch.zeros(live[name].shape, dtype=live[name].dtype)
    for name in sorted(stepped):
        for key in specs[trainable[name]].scalars:
            # a 0-dim tensor (torch's Adam), or a number DCP saved as an object
            plain[state_entry(name, key)] = torch.zeros((), dtype=torch.float64) \
                if hasattr(saved[state_entry(name, key)], "size") else None
    if load_optimizer:
        plain.update({k: None for k in saved if k.startswith(GROUPS_PREFIX)})
    if COUNTERS_KEY in saved:
        plain[COUNTERS_KEY] = None
    if SCHEDULE_KEY in saved and load_lr_scheduler:
        plain[SCHEDULE_KEY] = None
    if TRAIN_STEP_KEY in saved and hasattr(saved[TRAIN_STEP_KEY], "size"):
        plain[TRAIN_STEP_KEY] = torch.zeros((), dtype=torch.float64)
    return _Plan(reader, boxes, plain, units, specs, stepped, whole, load_optimizer)


def _read_steps(plan: _Plan) -> dict[str, int]:
    """Each stepped parameter's step count, read (a 0-dim tensor, or a number saved as an object)."""
    out = {}
    for name in plan.stepped:
        value = plan.plain.get(state_entry(name, "step"))
        if value is not None:
            out[name] = int(round(float(value)))
    return out


def _saved_groups(engine: CheckpointEngine, plan: _Plan) -> dict[int, dict]:
    """{user group index: the saved hyper-parameters of its parameters' group}, from either form of torch's
    param groups; its parameters must share one saved group."""
    saved = {k[len(GROUPS_PREFIX):]: v for k, v in plan.plain.items() if k.startswith(GROUPS_PREFIX)}
    tensors = cs.describe_tensors(engine)
    by_index = {}  # get_state_dict's form: group i with its params
    for key, value in saved.items():
        head, _, option = key.rpartition(".")
        if option == "params" and head.isdigit():
            by_index[int(head)] = {"params": value}
    for i, group in by_index.items():
        group.update({k[len(f"{i}."):]: v for k, v in saved.items()
                      if k.startswith(f"{i}.") and k != f"{i}.params" and "." not in k[len(f"{i}."):]})
    out = {}
    for user, _ in cs.inner_groups(engine):
        params = [n for n, e in tensors.items() if e["kind"] == "param" and e["group"] == user and not e["alias_of"]]
        if by_index:
            found = {i for i, g in by_index.items() if set(g["params"]) & set(params)}
            if len(found) > 1:
                raise CheckpointError(f"the parameters of optimizer group {user} ({', '.join(params[:4])} ...) are "
                                      f"in several groups of the checkpoint ({sorted(found)}); build the optimizer "
                                      f"with the groups the checkpoint was saved with")
            out[user] = {k: v for k, v in by_index[found.pop()].items() if k != "params"} if found else {}
        else:  # flatten_optimizer_state_dict's form: each parameter's options
            first = params[0] if params else None
            out[user] = {k[len(first) + 1:]: v for k, v in saved.items() if first and k.startswith(first + ".")
                         and "." not in k[len(first) + 1:]}
    return out


@torch.no_grad()
def _apply(engine: CheckpointEngine, plan: _Plan, steps: dict[str, int], groups: dict[int, dict]) -> None:
    """Set the units' masters, shards and optimizer state, the groups' hyper-parameters, whole tensors and step
    counts from what DCP read."""
    device_of = engine.optimizer.scalar_state_device
    for read in plan.units:
        unit, master = read.unit, read.master
        with unit.resident(dirty=True):
            if master is None:
                unit.param_shard.copy_(read.values[None])
                continue
            master.copy_(read.values[None])
            if plan.load_optimizer:
                index = cs.master_index(engine, master)
                state = {k: v for k, v in read.values.items() if k is not None}
                if state:  # some parameter of the unit stepped: its chunks' count is the largest
                    spec = plan.specs[unit.group_index]
                    chunk_step = max((steps.get(n, 0) for n in read.names), default=0)
                    for key, template in spec.scalars.items():
                        state[key] = _scalar_value(template, chunk_step if key == "step" else float(template),
                                                   device_of(index))
                engine.optimizer.load_state_of(index, state)
            if unit.param_shard.data_ptr() != master.data_ptr():
                unit.param_shard.copy_(master)  # mixed precision: the model's shard, downcast
    if plan.load_optimizer:
        for user, group in cs.inner_groups(engine):
            group.update({k: v for k, v in groups.get(user, {}).items()
                          if k in group and k not in _IMPLEMENTATION_OPTIONS})
        names = cs.canonical_names(engine)
        engine.optimizer.load_param_steps({pid: steps.get(name, 0) for pid, name in names.items()})
    live = engine.module.state_dict(keep_vars=True)
    for key, name in plan.whole.items():
        live[name].data.copy_(plan.plain[key])
