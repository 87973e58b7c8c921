"""One sharded unit's part of a checkpoint, saved and loaded unit by unit: a rank holds at most one
unit's values beyond its training state while it saves or loads.

[Note: streaming checkpoints] A rank's shard file holds, per unit, its master slices and optimizer
state (state.py's module docstring). With offload (offload/), those live on disk and only a few
units fit in memory, so neither direction may gather them all first:
  save: `plan_save` lists every entry of the file from what is known without reading any value
        (layouts, `state_spec_of`: state keys, dtypes and scalars), which gives the safetensors
        header; `stream_save` then makes one unit resident (its parameter shard, its optimizer state
        read back from the offload store), yields its slices to the writer and lets it go.
  load: `plan_load` works out from meta.json alone which saved slices each unit needs, so every
        check that can fail (missing or mismatching entries, coverage, optimizer state that does not
        merge) runs before anything changes; `load_unit` then reads one unit's slices, applies them
        to its shard and optimizer state (written to the offload store) and drops them.
Held beyond training: one unit's master, its state tensors and the copy `state_of` / `load_state_of`
make of them (about 3 x 12 bytes x the unit's shard for Adam), never a whole rank's shard.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Optional

import torch

from . import format as fmt
from . import state as cs
from ..errors import CheckpointError
from ..shard.seams import CheckpointEngine


# -- saving ----------------------------------------------------------------------------------------


class UnitSave(NamedTuple):
    """What one unit writes: file entries as (key, source, elements of the source or None: whole)."""

    unit: Any
    master: Optional[torch.Tensor]
    index: Optional[int]                                     # master index (None: frozen unit)
    pieces: list[tuple[str, Any, Optional[slice]]]


def plan_save(engine: CheckpointEngine) -> tuple[list, list[UnitSave], list, list]:
    """This rank's shard file without reading any value: (header specs, per-unit saves, segments for
    meta.json, unit entries for meta.json)."""
    names = cs.canonical_names(engine)
    optimizer = engine.optimizer
    specs, saves, segments, units = [], [], [], []
    for unit, master in cs.sharded_units(engine):
        if (unit.layout.num_shards == 1 and engine.rank != 0) or engine.sharding.replica_index != 0:
            continue  # replicated on every rank (stage 0) or in every MiCS block: the first copy is enough
        index = cs.master_index(engine, master) if master is not None else None
        elementwise, scalars = optimizer.state_spec_of(index) if master is not None else ({}, {})
        kinds = {fmt.MASTER: master.dtype} if master is not None else {fmt.FROZEN: unit.param_shard.dtype}
        kinds.update(sorted(elementwise.items()))
        entry = {"group": unit.group_index if master is not None else -1, "state_keys": sorted(elementwise),
                 "scalars": {k: cs.encode_scalar(k, v) for k, v in scalars.items()}}
        units.append(entry)
        pieces = []
        if master is not None and unit.layout.whole_tensors:
            entry["param_state"] = _plan_saved_tensor_states(engine, unit, index, names, specs, pieces)
        for seg in unit.layout.segments(unit.shard_index):
            name = names[id(unit.params[seg.param_index])]
            sl = slice(seg.shard_start, seg.shard_start + seg.numel)
            for kind, dtype in kinds.items():
                key = fmt.tensor_key(kind, name, seg.param_start, seg.param_end)
                specs.append((key, dtype, (seg.numel,)))
                pieces.append((key, kind, sl))
            segments.append((name, seg.param_start, seg.param_end, len(units) - 1))
        saves.append(UnitSave(unit, master, index, pieces))
    return specs, saves, segments, units


def _plan_saved_tensor_states(engine: CheckpointEngine, unit, index: int, names: dict, specs: list,
                              pieces: list) -> dict:
    """Whole-tensor unit: one entry per state tensor of each owned parameter; returns the unit entry's
    `param_state`: {name: {"tensors": [keys], "scalars": {key: encoded}}} (state.py's docstring)."""
    out = {}
    for param_index, state in engine.optimizer.tensor_states_of(index).items():
        name = names[id(unit.params[param_index])]
        entry = out[name] = {"tensors": [], "scalars": {}}
        for key, value in sorted(state.items()):
            if torch.is_tensor(value):
                file_key = fmt.tensor_key(f"param_state.{key}", name, 0, 0)
                specs.append((file_key, value.dtype, tuple(value.shape)))
                pieces.append((file_key, (param_index, key), None))
                entry["tensors"].append(key)
            else:
                entry["scalars"][key] = cs.encode_scalar(key, value)
    return out


def stream_save(engine: CheckpointEngine, saves: list[UnitSave]) -> Iterator[tuple[str, torch.Tensor]]:
    """The values of `plan_save`'s entries in order, one unit resident at a time."""
    optimizer = engine.optimizer
    for save in saves:
        with save.unit.resident():  # offload_param: one unit's shard in memory at a time
            if save.master is None:
                sources = {fmt.FROZEN: save.unit.param_shard}
            else:
                sources = {fmt.MASTER: save.master, **optimizer.state_of(save.index)}
                if save.unit.layout.whole_tensors:
                    for param_index, state in optimizer.tensor_states_of(save.index).items():
                        sources.update({(param_index, k): v for k, v in state.items()})
            for key, source, sl in save.pieces:
                if source not in sources:
                    raise CheckpointError(f"internal error: {key!r} was announced but the optimizer state has no "
                                          f"{source!r} now")
                value = sources[source].detach()
                yield key, value[sl] if sl is not None else value.contiguous()
            del sources  # this unit's copies go before the next unit's are made


# -- loading ---------------------------------------------------------------------------------------


class UnitLoad(NamedTuple):
    """What one unit reads: slices (file, saved name, saved range, range within it, target range),
    the optimizer state keys and encoded scalars (trainable units), whole-tensor owners."""

    unit: Any
    master: Optional[torch.Tensor]
    index: Optional[int]
    reads: list[tuple[str, str, int, int, int, int, slice]]
    state_keys: list[str]
    scalars: dict
    tensor_states: list[tuple[int, str, str, dict]]          # (param_index, file, name, saved entry)


def plan_load(engine: CheckpointEngine, meta: dict) -> list[UnitLoad]:
    """Every unit's reads, from meta.json alone; raises CheckpointError for any entry that does not fit."""
    names = cs.canonical_names(engine)
    return [_plan_unit(engine, unit, master, names, meta) for unit, master in cs.sharded_units(engine)]


def _plan_unit(engine: CheckpointEngine, unit, master, names: dict, meta: dict) -> UnitLoad:
    world = meta["world_size"]
    reads, state_keys, scalars = [], None, None
    for seg in unit.layout.segments(unit.shard_index):
        name = names[id(unit.params[seg.param_index])]
        saved_segments = meta["segments"].get(name)
        if master is None and saved_segments is None:
            # a frozen parameter saved whole (stages 0-2) in the model-states file
            reads.append((fmt.MODEL_STATES_FILE, name, seg.param_start, seg.param_end, 0, 0,
                          slice(seg.shard_start, seg.shard_start + seg.numel)))
            continue
        for rank, start, end, index, lo, hi in fmt.overlapping(saved_segments or [], seg.param_start, seg.param_end):
            saved = meta["units"][rank][index]
            if master is not None:
                if state_keys is None:
                    state_keys, scalars = saved["state_keys"], saved["scalars"]
                elif saved["state_keys"] != state_keys or saved["scalars"] != scalars:
                    raise CheckpointError(
                        f"parameters saved in different optimizer states end up in one shard here (e.g. {name}: "
                        f"{saved['scalars']} vs {scalars}); zerodp can only merge state that agrees, as it does "
                        f"when a group's parameters step together")
            dst = slice(seg.shard_start + lo - seg.param_start, seg.shard_start + hi - seg.param_start)
            reads.append((fmt.shard_file(rank, world), name, start, end, lo - start, hi - start, dst))
    if master is not None and state_keys is None:  # a shard of padding only: its group's state keys
        saved = next((u for units in meta["units"] for u in units if u["group"] == unit.group_index), None)
        state_keys, scalars = (saved["state_keys"], saved["scalars"]) if saved else ([], {})
    index = cs.master_index(engine, master) if master is not None else None
    owners = _plan_tensor_states(unit, names, meta) if master is not None and unit.layout.whole_tensors else []
    return UnitLoad(unit, master, index, reads, state_keys or [], scalars or {}, owners)


def _plan_tensor_states(unit, names: dict, meta: dict) -> list[tuple[int, str, str, dict]]:
    """Whole-tensor unit: where each owned parameter's saved state is (none: saved before any step)."""
    out = []
    for seg in unit.layout.segments(unit.shard_index):
        name = names[id(unit.params[seg.param_index])]
        saved = meta["segments"].get(name, [])
        entries = [(rank, meta["units"][rank][index].get("param_state")) for rank, _, _, index in saved]
        if any(entry is None for _, entry in entries):
            raise CheckpointError(f"{name}: the checkpoint keeps its optimizer state per element, but this "
                                  f"engine's optimizer reads whole tensors; use the optimizer it was saved with")
        owners = [(rank, entry[name]) for rank, entry in entries if name in entry]
        if owners:
            rank, entry = owners[0]
            out.append((seg.param_index, fmt.shard_file(rank, meta["world_size"]), name, entry))
    return out


def files_needed(loads: list[UnitLoad]) -> set[str]:
    """The files `load_unit` will read (verified against their checksums before anything changes)."""
    return {r[0] for load in loads for r in load.reads} | {t[1] for load in loads for t in load.tensor_states}


@torch.no_grad()
def load_unit(engine: CheckpointEngine, load: UnitLoad, files: fmt.CheckpointFiles) -> None:
    """Read one unit's slices and set its shard (and master and optimizer state); see the module note."""
    unit, master = load.unit, load.master
    with unit.resident(dirty=True):
        if master is None:
            unit.param_shard.copy_(_read_values(load, files, unit.param_shard, fmt.FROZEN))
            return
        new_master = _read_values(load, files, master, fmt.MASTER)
        master.copy_(new_master)
        del new_master
        state = {key: _read_values(load, files, master, key) for key in load.state_keys}
        device = engine.optimizer.scalar_state_device(load.index)
        state.update({k: cs.decode_scalar(v, device) for k, v in load.scalars.items()})
        engine.optimizer.load_state_of(load.index, state)
        del state
        if unit.layout.whole_tensors:
            engine.optimizer.load_tensor_states_of(load.index, _read_tensor_states(load, files))
        if unit.param_shard.data_ptr() != master.data_ptr():
            unit.param_shard.copy_(master)  # mixed precision: the model's shard, downcast


def _read_values(load: UnitLoad, files: fmt.CheckpointFiles, like: torch.Tensor, kind: str) -> torch.Tensor:
    """A new tensor shaped like `like` holding the saved `kind` ("master", "frozen" or a state key) of
    every read of `load`; padding stays zero. A state tensor keeps its saved dtype."""
    out = None
    for file, name, start, end, lo, hi, dst in load.reads:
        if file == fmt.MODEL_STATES_FILE:
            piece = files.read_value(name, start, end)
        else:
            piece = files.read_slice(file, fmt.tensor_key(kind, name, start, end), lo, hi)
        if out is None:
            out = torch.zeros(like.shape, dtype=piece.dtype if kind not in (fmt.MASTER, fmt.FROZEN) else like.dtype,
                              device=like.device)
        out[dst] = piece
    return out if out is not None else torch.zeros_like(like)


def _read_tensor_states(load: UnitLoad, files: fmt.CheckpointFiles) -> dict[int, dict]:
    out = {}
    for param_index, file, name, entry in load.tensor_states:
        reader = files.tensors(file)
        state = {k: reader.get_tensor(fmt.tensor_key(f"param_state.{k}", name, 0, 0)) for k in entry["tensors"]}
        state.update({k: cs.decode_scalar(v, torch.device("cpu")) for k, v in entry["scalars"].items()})
        out[param_index] = state
    return out
