"""Checkpoints of an expert-parallel run (stages 0-3) that load at another expert-parallel or data-parallel size:
`save_expert_checkpoint`, `load_expert_checkpoint`.

Files under save_dir/tag, each written by one rank, every tensor whole and named as in the single-process model
(experts under their global index, moe/consolidate.py):

    dense.pt          rank 0: each dense parameter's fp32 master and optimizer state, the counters, the loss
                      scaler, the lr schedule, the client state
    experts_ep<j>.pt  expert-parallel rank j (rank j of the engine's group, in the first expert-parallel
                      group): its experts' fp32 masters and optimizer state

Per parameter: `value` (fp32), `state` (its slice of every elementwise optimizer state), `scalars` (its unit's
scalar state, e.g. Adam's step) and `step` (its own step count, where it keeps one: optim/step_counts.py).
Loading, each rank reads every file (whole tensors: sized for models whose state fits one host) and cuts its
shards out of the whole tensors by its own layout, whatever the sizes were at save.

Packed experts (moe/packed.py: one tensor [E, ...] per weight, rank j holding experts j*L .. j*L+L-1 under the
model's own name) are saved as one entry per expert-parallel rank, `<name>#experts<j*L>`; loading puts the pieces
back in expert order and cuts this rank's experts out, so they too load at another expert-parallel size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from .. import comm
from ..checkpoint.consolidate import gather_flat
from ..errors import CheckpointError
from .consolidate import global_expert_names, shard_group
from .expert_groups import ExpertPlan
from .packed import PackedExperts

LATEST = "latest"


PACKED = "#experts"  # <name>#experts<first global expert>: one rank's piece of a packed-experts tensor


def _packed_pieces(plan: ExpertPlan) -> dict[int, tuple[int, int]]:
    """id(parameter) -> (its first global expert, its number of experts), for packed experts' parameters."""
    return {id(p): (layer.global_expert_index(0), layer.num_local_experts) for layer in plan.layers
            if isinstance(layer, PackedExperts) for p in layer.expert_parameters()}


def _names(engine, plan: ExpertPlan) -> dict[int, str]:
    """id(parameter) -> its single-process name (a packed expert tensor's piece: see the module docstring)."""
    renamed = global_expert_names(engine.module, plan)
    pieces = _packed_pieces(plan)
    return {id(p): f"{n}{PACKED}{pieces[id(p)][0]}" if id(p) in pieces else renamed.get(n, n)
            for n, p in engine.module.named_parameters()}


def _join_packed(entries: dict[str, dict]) -> dict[str, dict]:
    """Each packed tensor's pieces (`<name>#experts<first>`) as one entry `<name>` holding every expert, in order.
    Pieces whose scalar state or step counts differ (an expert-parallel rank that got no token in some step) cannot
    be one tensor of one optimizer's state: they stay as saved, loadable only at the same expert-parallel size."""
    pieces: dict[str, list[tuple[int, str]]] = {}
    for key in entries:
        if PACKED in key:
            name, _, first = key.rpartition(PACKED)
            pieces.setdefault(name, []).append((int(first), key))
    for name, parts in pieces.items():
        parts = [entries[key] for _, key in sorted(parts)]
        entry = parts[0]
        if any(other["step"] != entry["step"] or other["scalars"].keys() != entry["scalars"].keys() or any(
                not torch.equal(torch.as_tensor(other["scalars"][k]), torch.as_tensor(entry["scalars"][k]))
                for k in entry["scalars"]) for other in parts[1:]):
            continue
        entries[name] = {"value": torch.cat([part["value"] for part in parts]),
                         "state": {k: torch.cat([part["state"][k] for part in parts]) for k in entry["state"]},
                         "scalars": entry["scalars"], "step": entry["step"]}
    return entries


def _cut_packed(entries: dict[str, dict], engine, plan: ExpertPlan, folder) -> None:
    """This rank's experts of every packed tensor, under the names `_names` gives them (module docstring)."""
    pieces = _packed_pieces(plan)
    for name, p in engine.module.named_parameters():
        if id(p) not in pieces:
            continue
        first, count = pieces[id(p)]
        key = f"{name}{PACKED}{first}"
        if key in entries and entries[key]["value"].shape[0] == count:
            continue  # saved at this expert-parallel size: this rank's piece as it was
        whole = entries.get(name)
        if whole is None:
            if any(k.startswith(name + PACKED) for k in entries):
                raise CheckpointError(f"{folder}: the expert-parallel ranks' pieces of {name} were stepped a different "
                                      f"number of times (one rank's experts got no token in some step), so they are "
                                      f"not one tensor's optimizer state; load this checkpoint at the "
                                      f"expert-parallel size it was saved with")
            continue  # not in the checkpoint at all: reported with the other missing parameters
        if whole["value"].shape[0] < first + count:
            raise CheckpointError(f"the checkpoint's {name} holds {whole['value'].shape[0]} experts; this model "
                                  f"has more: it was saved from another model (or with other num_experts)")
        entries[key] = {"value": whole["value"][first:first + count], "scalars": whole["scalars"],
                        "step": whole["step"], "state": {k: v[first:first + count] for k, v in whole["state"].items()}}


@torch.no_grad()
def _whole_entries(engine, plan: ExpertPlan) -> dict[str, dict]:
    """Every parameter of this rank's units, whole (collectives over each unit's group)."""
    names = _names(engine, plan)
    steps = engine.optimizer.param_steps()
    chunk = engine.config.zero_optimization.allgather_bucket_size
    device = engine.placement.compute.device
    entries = {}
    for index, (unit, master) in enumerate(zip(engine.units, engine.optimizer.masters)):
        if unit.layout.whole_tensors:
            raise NotImplementedError("checkpoints of expert-parallel runs with a whole-tensor optimizer (Muon, "
                                      "Adafactor) are not implemented")
        state = engine.optimizer.state_of(index)
        elementwise = {k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == master.shape}
        scalars = {k: v for k, v in state.items() if k not in elementwise}
        flats = {k: gather_flat(unit.layout, v, shard_group(unit), chunk, True, device=device)
                 for k, v in [("value", master), *sorted(elementwise.items())]}
        for p, offset, numel, shape in zip(unit.params, unit.layout.offsets, unit.layout.numels, unit.layout.shapes):
            cut = {k: f[offset:offset + numel].view(shape).clone() for k, f in flats.items()}
            entries[names[id(p)]] = {"value": cut.pop("value"), "state": cut, "scalars": scalars,
                                     "step": steps.get(id(p))}
    return entries


def save_expert_checkpoint(engine, plan: ExpertPlan, save_dir, tag: Optional[str] = None,
                           client_state: Optional[dict] = None) -> str:
    """Write the files of the module docstring; every rank calls it. Returns the checkpoint's folder."""
    tag = tag if tag is not None else f"global_step{engine.global_step}"
    folder = Path(save_dir) / tag
    entries = _whole_entries(engine, plan)
    group = engine.process_group
    rank = comm.get_rank(group)
    experts = set(global_expert_names(engine.module, plan).values()) | {
        k for k in entries if PACKED in k}
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    comm.all_gather_object(None, group)  # note: a barrier, the folder exists before anyone writes into it
    largest = max(plan.groups)
    if rank < largest:  # the first expert-parallel group holds every expert once
        torch.save({k: v for k, v in entries.items() if k in experts}, folder / f"experts_ep{rank}.pt")
    if rank == 0:
        schedule = engine.lr_scheduler
        torch.save({"params": {k: v for k, v in entries.items() if k not in experts},
                    "counters": {"global_step": engine.global_step, "micro_step": engine.micro_step,
                                 "skipped_steps": engine.skipped_steps,
                                 "gradient_accumulation_steps": engine.gradient_accumulation_steps},
                    "loss_scaler": engine.scaler.state_dict(),
                    "lr_scheduler": None if schedule is None else schedule.state_dict(),
                    "client_state": client_state or {}, "ep_sizes": sorted(plan.groups)}, folder / "dense.pt")
        (Path(save_dir) / LATEST).write_text(tag)
    comm.all_gather_object(None, group)  # every file is written before anyone returns
    return str(folder)


@torch.no_grad()
def load_expert_checkpoint(engine, plan: ExpertPlan, load_dir, tag: Optional[str] = None,
                           load_lr_scheduler: bool = True) -> dict:
    """Read the files of `save_expert_checkpoint` into this engine's shards (any EP or DP size); returns the
    client state. The caller re-assembles the full parameters (strategy.after_step)."""
    if tag is None:
        latest = Path(load_dir) / LATEST
        if not latest.exists():
            raise CheckpointError(f"no {LATEST} file under {load_dir}: pass tag=")
        tag = latest.read_text().strip()
    folder = Path(load_dir) / tag
    if not (folder / "dense.pt").exists():
        raise CheckpointError(f"{folder} holds no expert-parallel checkpoint (dense.pt); was it saved by an "
                              f"engine with MoE layers?")
    dense = torch.load(folder / "dense.pt", weights_only=False)
    entries = dict(dense["params"])
    for path in sorted(folder.glob("experts_ep*.pt")):
        entries.update(torch.load(path, weights_only=False))
    _cut_packed(_join_packed(entries), engine, plan, folder)
    names = _names(engine, plan)
    missing = sorted(n for n in names.values() if n not in entries)
    if missing:
        raise CheckpointError(f"the checkpoint {folder} lacks {len(missing)} parameter(s) of this model, e.g. "
                              f"{missing[:3]}: it was saved from another model (or with other num_experts)")
    steps = {}
    for index, (unit, master) in enumerate(zip(engine.units, engine.optimizer.masters)):
        first = entries[names[id(unit.params[0])]]
        start, end = unit.layout.shard_ranges()[unit.shard_index]

        def shard_of(key: Optional[str]) -> torch.Tensor:
            full = torch.zeros(unit.layout.padded_numel, dtype=torch.float32)
            for p, offset, numel in zip(unit.params, unit.layout.offsets, unit.layout.numels):
                entry = entries[names[id(p)]]
                full[offset:offset + numel] = (entry["value"] if key is None else entry["state"][key]).reshape(-1)
            return full[start:end]

        master.copy_(shard_of(None).to(master.dtype))
        with unit.resident(dirty=True):
            if unit.param_shard.data_ptr() != master.data_ptr():
                unit.param_shard.copy_(master.to(unit.param_shard.dtype))
        state = {k: shard_of(k).to(master.device) for k in first["state"]}
        state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in first["scalars"].items()})
        engine.optimizer.load_state_of(index, state)
        for p in unit.params:
            if entries[names[id(p)]]["step"] is not None:
                steps[id(p)] = entries[names[id(p)]]["step"]
    engine.optimizer.load_param_steps(steps or None)
    engine.scaler.load_state_dict(dense["loss_scaler"])
    if load_lr_scheduler and dense["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(dense["lr_scheduler"])
    counters = dense["counters"]
    engine.global_step, engine.skipped_steps = counters["global_step"], counters["skipped_steps"]
    same = counters["gradient_accumulation_steps"] == engine.gradient_accumulation_steps
    engine.micro_step = counters["micro_step"] if same else engine.global_step * engine.gradient_accumulation_steps
    return dense["client_state"]
