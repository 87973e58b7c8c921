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

LATEST = "latest"


def _names(engine, plan: ExpertPlan) -> dict[int, str]:
    """id(parameter) -> its single-process name."""
    renamed = global_expert_names(engine.module, plan)
    return {id(p): renamed.get(n, n) for n, p in engine.module.named_parameters()}


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
    experts = set(global_expert_names(engine.module, plan).values())
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
