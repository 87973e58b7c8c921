"""A checkpoint in DeepSpeed's ZeRO layout, for DeepSpeed's own tools: `write_deepspeed_layout`.

It writes, into a committed zerodp tag folder, the files DeepSpeed 0.19.8 writes for the same model, optimizer, world
size and stage (the layout deepspeed_reader.py's docstring describes, and DeepSpeed's zero_to_fp32.py reads):
`mp_rank_00_model_states.pt` (stages 1-2) or `zero_pp_rank_<r>_mp_rank_00_model_states.pt` (stage 3, one per rank),
and `[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt` for every rank r. So
  - DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint` and zero_to_fp32.py read the fp32 weights;
  - DeepSpeed's `load_checkpoint`, at the same world size and stage, with the same script's model and optimizer
    groups, restores the module, the fp32 masters, Adam's moments and step, the lr schedule, the counters, the loss
    scaler and the client state, and trains on as zerodp would (bench/results/deepspeed_reads_zerodp.md).
The layout is DeepSpeed's, not zerodp's units: each optimizer group's trainable parameters back to back in the
model's order (`_groups`), cut into equal contiguous partitions after padding to 2 x world elements
(stages 1-2), or each parameter cut into ceil(numel / world) elements per rank (stage 3; one sub-group per optimizer
group, DeepSpeed's default sub_group_size of 1e9 elements). zerodp's own files stay (meta.json and its shards);
zerodp reads those, never these.

Cost: the whole fp32 masters and optimizer state of every parameter are gathered (one parameter at a time, a
collective) and rank 0 holds them all while it writes every rank's files: about 12 bytes x parameters for Adam.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import torch

from . import state as cs
from .deepspeed_pickle import DynamicLossScaler, LossScaler, fragment_address, save_deepspeed_file
from .param_values import MASTER, whole_param_value
from .. import comm
from ..errors import CheckpointError
from ..shard.seams import CheckpointEngine

DEEPSPEED_VERSION = "0.19.8"  # the release whose layout this is


def optim_file(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def model_file(rank: int, stage: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage >= 3 else "mp_rank_00_model_states.pt"


def _groups(engine: CheckpointEngine) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Each optimizer group's trainable parameters by first name, in the model's order: zerodp's order
    (preflight.optimizer_groups), and DeepSpeed's (the group's list order) whenever the groups were built by filtering
    model.parameters(), as the HF Trainer and Lightning build them."""
    group_of = {id(p): unit.group_index for unit in engine.units for p in unit.params}
    out: list[list] = [[] for _ in engine.user_optimizer.param_groups]
    for name, p in engine.module.named_parameters():  # tied parameters once, under their first name
        if id(p) in group_of:
            out[group_of[id(p)]].append((name, p))
    return out


def _group_state_specs(engine: CheckpointEngine) -> dict[int, tuple[list[str], dict]]:
    """Per user group: its elementwise optimizer state keys and its scalars (Adam's step), from its first unit."""
    out: dict[int, tuple[list[str], dict]] = {}
    for index, unit in enumerate(engine.units):
        if unit.group_index not in out:
            elementwise, scalars = engine.optimizer.state_spec_of(index)
            out[unit.group_index] = (sorted(elementwise), scalars)
    return out


def _loss_scaler(engine: CheckpointEngine) -> LossScaler:
    """DeepSpeed's loss scaler object for zerodp's scaler (the inverse of deepspeed_reader.loss_scaler_state)."""
    scaler, state = engine.scaler, engine.scaler.state_dict()
    if not scaler.dynamic:
        return LossScaler(state["scale"])
    ds = DynamicLossScaler(state["scale"])
    cur_iter = engine.global_step
    ds.__dict__.update(dynamic=True, cur_iter=cur_iter, last_overflow_iter=cur_iter - state["clean_steps"] - 2,
                       scale_factor=float(scaler.factor), scale_window=scaler.window, min_scale=scaler.min_scale,
                       delayed_shift=scaler.hysteresis, cur_hysteresis=state["hysteresis_left"],
                       consecutive_hysteresis=scaler.consecutive_hysteresis, raise_error_at_min_scale=True,
                       dtype=torch.float16)
    return ds


def write_deepspeed_layout(engine: CheckpointEngine, tag_dir, client_state: Optional[dict] = None,
                           ds_config: Optional[dict] = None) -> None:
    """Write DeepSpeed's files of `engine`'s state into `tag_dir` (a collective: every rank calls it; rank 0 writes)."""
    stage, world = engine.stage, engine.world_size
    if stage not in (1, 2, 3):
        raise CheckpointError(f"DeepSpeed's ZeRO layout exists for stages 1-3; this engine runs stage {stage}: save "
                              f"zerodp's format only (it reshards to any stage on load)")
    groups = _groups(engine)
    specs = _group_state_specs(engine)
    whole: dict[str, dict[str, torch.Tensor]] = {}
    for g, members in enumerate(groups):
        keys = specs.get(g, ([], {}))[0]
        for name, p in members:  # note: collectives, in the same order on every rank
            values = {MASTER: whole_param_value(engine, p, MASTER)}
            for key in keys:
                value = whole_param_value(engine, p, key)
                values[key] = value if value is not None else torch.zeros_like(values[MASTER])
            whole[name] = values
    frozen = {n: v for n, v in (engine.full_state_dict(rank0_only=True) or {}).items()}  # collective; rank 0 only
    error = None
    if engine.rank == 0:
        try:
            _write_files(engine, Path(tag_dir), groups, specs, whole, frozen, client_state, ds_config)
        except Exception as err:  # reported on every rank below: no rank returns before the files exist
            error = err
    messages = comm.all_gather_object(None if error is None else f"{type(error).__name__}: {error}",
                                      engine.process_group)
    if messages[0] is not None:
        raise CheckpointError(f"DeepSpeed's files of {tag_dir} were not all written (rank 0: {messages[0]}); zerodp's "
                              f"own checkpoint there is complete and loads") from error


def _write_files(engine: CheckpointEngine, tag_dir: Path, groups, specs, whole, frozen, client_state, ds_config) -> None:
    stage, world = engine.stage, engine.world_size
    bf16 = engine.config.bf16.enabled
    hyper = {user: cs.encode_hyper(group) for user, group in cs.inner_groups(engine)}
    param_groups = [{**{k: cs.decode_hyper(v) for k, v in hyper.get(g, {}).items()}, "params": [g]}
                    for g in range(len(groups))]
    common = {"loss_scaler": _loss_scaler(engine), "dynamic_loss_scale": bool(engine.scaler.dynamic),
              "overflow": False, "zero_stage": stage}
    for rank in range(world):
        if stage >= 3:
            optim = {**common, "partition_count": world,
                     "optimizer_state_dict": _inner_state(groups, whole, specs, rank, world, _stage3_part, param_groups),
                     "fp32_flat_groups": [_stage3_part([whole[n][MASTER] for n, _ in m], rank, world) for m in groups]}
        else:
            optim = {**common, "clip_grad": float(engine.config.gradient_clipping),
                     "base_optimizer_state": _inner_state(groups, whole, specs, rank, world, _stage12_part,
                                                          param_groups),
                     "single_partition_of_fp32_groups": [_stage12_part([whole[n][MASTER] for n, _ in m], rank, world)
                                                         for m in groups],
                     "group_paddings": [_stage12_padding(m, whole, rank, world) for m in groups],
                     "param_alignment_paddings": [[0] * len(m) for m in groups],
                     "partition_count": [world] * len(groups), "ds_version": DEEPSPEED_VERSION,
                     "param_slice_mappings": [_slice_mappings(m, whole, rank, world) for m in groups]}
        save_deepspeed_file({"optimizer_state_dict": optim, "ds_config": ds_config or {},
                             "ds_version": DEEPSPEED_VERSION}, tag_dir / optim_file(rank, bf16))
    for rank in range(world if stage >= 3 else 1):
        save_deepspeed_file(_model_states(engine, groups, frozen, rank, client_state, ds_config),
                            tag_dir / model_file(rank, stage))


def _inner_state(groups, whole, specs, rank: int, world: int, part, param_groups) -> dict:
    """The inner optimizer's state_dict over the flat groups: {state: {g: {step, exp_avg, ...}}, param_groups}."""
    state = {}
    for g, members in enumerate(groups):
        keys, scalars = specs.get(g, ([], {}))
        if not members or not keys:
            continue
        state[g] = {**{k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()},
                    **{k: part([whole[n][k] for n, _ in members], rank, world) for k in keys}}
    return {"state": state, "param_groups": param_groups}


def _stage12_flat(values: list[torch.Tensor], world: int) -> torch.Tensor:
    flat = torch.cat([v.reshape(-1).float() for v in values]) if values else torch.zeros(0)
    align = 2 * world  # DeepSpeed pads each group's flat vector to a multiple of 2 x world elements
    return torch.nn.functional.pad(flat, (0, -flat.numel() % align))


def _stage12_part(values: list[torch.Tensor], rank: int, world: int) -> torch.Tensor:
    flat = _stage12_flat(values, world)
    size = flat.numel() // world
    return flat[rank * size:(rank + 1) * size].clone()


def _stage12_padding(members, whole, rank: int, world: int) -> int:
    """The padding in rank's partition: all of it on the last rank, as DeepSpeed counts it."""
    numel = sum(whole[n][MASTER].numel() for n, _ in members)
    return (-numel % (2 * world)) if rank == world - 1 else 0


def _slice_mappings(members, whole, rank: int, world: int) -> OrderedDict:
    """Which part of rank's partition each parameter fills (DeepSpeed's param_slice_mappings, for ds_to_universal)."""
    numel = sum(whole[n][MASTER].numel() for n, _ in members)
    size = (numel + (-numel % (2 * world))) // world
    lo, hi = rank * size, (rank + 1) * size
    out, offset = OrderedDict(), 0
    for name, _ in members:
        n = whole[name][MASTER].numel()
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            out[name] = fragment_address(numel=b - a, start=a - lo)
        offset += n
    return out


def _stage3_part(values: list[torch.Tensor], rank: int, world: int) -> torch.Tensor:
    pieces = []
    for v in values:
        flat = v.reshape(-1).float()
        piece = math.ceil(flat.numel() / world)
        pieces.append(torch.nn.functional.pad(flat, (0, piece * world - flat.numel()))[rank * piece:(rank + 1) * piece])
    return torch.cat(pieces).clone() if pieces else torch.zeros(0)


def _model_states(engine: CheckpointEngine, groups, full: dict, rank: int, client_state: Optional[dict],
                  ds_config: Optional[dict]) -> dict:
    """The model-states file: the module's state dict (in the model's dtypes; empty parameters at stage 3), the
    shapes zero_to_fp32 walks, the frozen parameters, the schedule, the counters and the client state."""
    stage, world = engine.stage, engine.world_size
    entries = cs.describe_tensors(engine)
    module = OrderedDict()
    for key, entry in entries.items():
        dtype = getattr(torch, entry["dtype"])
        value = full[entry["alias_of"] or key]
        if stage >= 3 and entry["kind"] != "buffer":
            module[key] = torch.empty(0, dtype=dtype)  # DeepSpeed saves stage 3's partitioned parameters empty
        else:
            module[key] = value.to(dtype) if value.is_floating_point() else value.clone()
    frozen_names = [k for k, e in entries.items() if e["kind"] == "frozen" and e["alias_of"] is None]
    frozen_shapes = OrderedDict((k, torch.Size(entries[k]["shape"])) for k in frozen_names)
    if stage >= 3:
        fragments = OrderedDict((k, _stage3_part([full[k]], rank, world).to(getattr(torch, entries[k]["dtype"])))
                                for k in frozen_names)
    else:
        fragments = OrderedDict((k, module[k]) for k in frozen_names)
    states = {
        "module": module,
        "buffer_names": [k for k, e in entries.items() if e["kind"] == "buffer"],
        "optimizer": None,
        "param_shapes": [OrderedDict((n, p.shape) for n, p in members) for members in groups],
        # DeepSpeed records frozen parameters from stage 2 on, so its zero_to_fp32 drops them from its own stage-1
        # checkpoints; written at every stage here, so that tool returns the whole model (its loader ignores them)
        "frozen_param_shapes": frozen_shapes,
        "shared_params": {k: e["alias_of"] for k, e in entries.items() if e["alias_of"] is not None},
        "frozen_param_fragments": fragments,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "data_sampler": None, "random_ltd": None,
        "skipped_steps": engine.skipped_steps, "global_steps": engine.global_step,
        "global_samples": engine.global_step * engine.train_batch_size,
        "dp_world_size": world, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": ds_config or {}, "ds_version": DEEPSPEED_VERSION,
    }
    clash = sorted(set(client_state or {}) & set(states))
    if clash:
        raise CheckpointError(f"client_state keys {clash} are DeepSpeed's own names in its model-states file; rename "
                              f"them (DeepSpeed merges the client state into that file)")
    return {**states, **(client_state or {})}

