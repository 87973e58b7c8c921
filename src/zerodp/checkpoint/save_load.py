"""Sharded checkpoints of a live engine: save, and load at any world size or stage (resharding).

Saving: every rank writes only the slices it owns (its fp32 master shard and the matching slices of
each optimizer state tensor, one safetensors entry per parameter segment), its RNG states, and
rank 0 adds the metadata, frozen parameters, buffers and client_state. The on-disk format is in
`checkpoint/format.py` (its docstring is the reference). The shard file is written one unit at a
time ([Note: streaming checkpoints] in units.py): with offload, a save holds one unit's values
beyond the training state, never the rank's whole shard.

[Note: atomic commit] A checkpoint becomes visible in one rename, only after every rank wrote all
its files:
  1. rank 0 removes stale `.tmp-*` directories and creates `.tmp-<tag>`;
  2. every rank writes its files there (each fsynced, hashed while written); a failure on any rank
     is reported to all ranks (an all-gather of outcomes, so nobody hangs) and nothing is renamed;
  3. rank 0 writes meta.json with every file's sha256, renames `.tmp-<tag>` to `<tag>` (an older
     `<tag>` is moved aside first and deleted last) and then rewrites `latest`;
  4. a final all-gather: no rank returns before the commit, so a load right after sees it.
A crash anywhere before step 3's rename leaves `latest` and every committed checkpoint untouched.
The directory must be on a filesystem every rank sees (rank 0 renames the other ranks' files).

Loading: every rank reads meta.json, checks that the checkpoint fits the model (names, shapes,
trainable or frozen, tying, optimizer groups and class), plans from the metadata alone which saved
slices overlap each of its *new* unit shards (`units.plan_load`: every mismatch is found here), and
verifies every rank file it will read against its checksum. Nothing in the engine changes until
every rank has planned its part without error (agreed by an all-gather), so a bad checkpoint
leaves the engine as it was; files are only ever read. Then each unit in turn reads its slices and
sets its master, optimizer state (written straight to the offload store where there is one) and
shard (`units.load_unit`), so the load holds one unit's values beyond the training state; then the
optimizer groups' hyper-parameters and the module's buffers are set. The rest is returned as `Resumed`
and applied by the engine (`ZeroEngine.load_checkpoint`: loss scaler, schedule, counters, RNG states,
re-assembling the parameters): a checkpoint reads and writes values, it never drives the engine. A read that fails during the unit pass (a disk error after the checksum
passed) is reported on every rank, saying the engine now holds a mix of states.

Errors: every problem is a `CheckpointError` (a ValueError), raised on every rank, naming the file
and the cause: a directory that does not exist or holds no checkpoint; a tag that does not exist
(the available tags are listed); a checkpoint of another model (names missing on either side,
shapes, trainable/frozen role, tying and optimizer groups that differ are listed); another
optimizer class; a missing rank file; a truncated or corrupted file (sha256 mismatch); unreadable
metadata; a save in the middle of gradient accumulation; a failed write on any rank during a save.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from . import format as fmt
from . import state as cs
from . import units as cu
from .. import comm
from ..errors import CheckpointError
from ..shard.seams import CheckpointEngine
from .deepspeed_reader import as_zerodp, deepspeed_tag_dir, read_deepspeed
from .consolidate import consolidate_checkpoint, consolidate_main, full_state_dict, save_consolidated

LR_SCHEDULER_FILE = "lr_scheduler.pt"  # rank 0: the learning-rate schedule's state_dict (optim.lr_schedules)

__all__ = ["save_checkpoint", "read_checkpoint", "Resumed", "full_state_dict", "consolidate_checkpoint", "save_consolidated",
           "consolidate_main", "CheckpointError"]


# -- saving ----------------------------------------------------------------------------------------


def save_checkpoint(engine: CheckpointEngine, save_dir, tag: Optional[str] = None, client_state: Optional[dict] = None) -> str:
    """Write a checkpoint of `engine` under save_dir/tag (every rank must call it); returns its path.

    Call it between optimizer steps (after the `engine.step()` that ends an accumulation cycle):
    gradients accumulated in the middle of a cycle are not saved.
    """
    group = engine.process_group
    save_dir = Path(save_dir)
    tag = fmt.validate_tag(tag if tag is not None else f"global_step{engine.global_step}")
    if not engine.at_step_boundary:
        raise CheckpointError(f"save_checkpoint was called in the middle of gradient accumulation (micro step "
                              f"{engine.micro_step}, {engine.gradient_accumulation_steps} per step); call it "
                              f"after the engine.step() that completes an optimizer step")
    tags = comm.all_gather_object(tag, group)
    if len(set(tags)) > 1:
        raise CheckpointError(f"ranks passed different checkpoint tags: {tags}; pass the same tag on every rank")
    tmp = save_dir / f"{fmt.TMP_PREFIX}{tag}"
    _run_on_rank0(engine, "prepare the temporary directory", lambda: _prepare_tmp(save_dir, tmp))

    written, error = None, None
    try:
        written = _write_rank_files(engine, tmp, client_state)
    except Exception as err:  # reported to every rank below, so no rank waits for a dead one
        error = err
    outcomes = comm.all_gather_object((written, None if error is None else f"{type(error).__name__}: {error}"),
                                  group)
    failed = [(r, msg) for r, (_, msg) in enumerate(outcomes) if msg is not None]
    if failed:
        if engine.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        rank, msg = failed[0]
        raise CheckpointError(f"checkpoint {tag!r} was not saved: rank {rank} failed while writing its files "
                              f"({msg}); the previous checkpoints in {save_dir} are untouched") from error

    _run_on_rank0(engine, "commit the checkpoint",
                  lambda: _commit(save_dir, tmp, tag, _build_meta(engine, tag, [w for w, _ in outcomes])))
    return str(save_dir / tag)


def _prepare_tmp(save_dir: Path, tmp: Path) -> None:
    save_dir.mkdir(parents=True, exist_ok=True)
    for stale in save_dir.glob(f"{fmt.TMP_PREFIX}*"):  # left by saves that crashed; never read
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()


def _write_rank_files(engine: CheckpointEngine, tmp: Path, client_state: Optional[dict]) -> dict:
    """This rank's files; returns what rank 0 needs for meta.json (segments, masters, checksums)."""
    rank, world = engine.rank, engine.world_size
    specs, saves, segments, units = cu.plan_save(engine)  # [Note: streaming checkpoints] in units.py
    files = {}
    name = fmt.shard_file(rank, world)
    files[name] = fmt.write_tensor_file(tmp / name, fmt.TensorStream(specs, cu.stream_save(engine, saves)),
                                        {"format": fmt.FORMAT_NAME, "rank": str(rank)})
    files[fmt.rng_file(rank)] = fmt.write_json(tmp / fmt.rng_file(rank), cs.rng_state())
    if rank == 0:
        files[fmt.MODEL_STATES_FILE] = fmt.write_tensor_file(tmp / fmt.MODEL_STATES_FILE, cs.model_states(engine))
        if client_state is not None:
            files[fmt.CLIENT_STATE_FILE] = fmt.write_torch(tmp / fmt.CLIENT_STATE_FILE, client_state)
        if engine.lr_scheduler is not None:
            files[LR_SCHEDULER_FILE] = fmt.write_torch(tmp / LR_SCHEDULER_FILE, engine.lr_scheduler.state_dict())
    return {"segments": segments, "units": units, "files": files}


def _build_meta(engine: CheckpointEngine, tag: str, written: list[dict]) -> dict:
    tensors = cs.describe_tensors(engine)
    segments: dict[str, list] = {k: [] for k, e in tensors.items() if e["kind"] == "param" and not e["alias_of"]}
    for rank, w in enumerate(written):
        for name, start, end, unit in w["segments"]:
            segments.setdefault(name, []).append([rank, start, end, unit])
    for name, segs in segments.items():
        segs.sort(key=lambda s: s[1])
        numel = int(torch.Size(tensors[name]["shape"]).numel())
        list(fmt.overlapping(segs, 0, numel))  # every element saved exactly once, or an error now
    groups = {str(user): cs.encode_hyper(g) for user, g in cs.inner_groups(engine)}
    cls, larc = cs.optimizer_class(engine)
    names = cs.canonical_names(engine)
    from .. import __version__

    return {
        "format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "tag": tag,
        "world_size": engine.world_size, "stage": engine.stage,
        "torch_version": torch.__version__, "zerodp_version": __version__,
        "config": engine.config.model_dump(mode="json"),
        "counters": {"global_step": engine.global_step, "micro_step": engine.micro_step,
                     "skipped_steps": engine.skipped_steps,
                     "gradient_accumulation_steps": engine.gradient_accumulation_steps},
        "loss_scaler": engine.scaler.state_dict(),
        "optimizer": {"class": cls, "larc": larc, "groups": groups},
        "tensors": tensors,
        "segments": segments,
        "units": [w["units"] for w in written],
        # each parameter's own Adam step count, by name (optim/step_counts.py): per parameter, not per shard
        "param_steps": {names[pid]: count for pid, count in engine.optimizer.param_steps().items()},
        "files": {name: digest for w in written for name, digest in w["files"].items()},
    }


def _commit(save_dir: Path, tmp: Path, tag: str, meta: dict) -> None:
    """Step 3 of [Note: atomic commit] (rank 0)."""
    fmt.write_json(tmp / fmt.META_FILE, meta)
    fmt.fsync_dir(tmp)
    final, trash = save_dir / tag, save_dir / f"{fmt.TRASH_PREFIX}{tag}"
    if final.exists():
        # A directory cannot be replaced by rename: move the old copy aside; until the rename below
        # is done, loading `tag` falls back to it (format.resolve_tag_dir).
        shutil.rmtree(trash, ignore_errors=True)
        final.rename(trash)
    tmp.rename(final)
    fmt.fsync_dir(save_dir)
    fmt.write_text_atomically(save_dir / fmt.LATEST_FILE, tag + "\n")  # written last: the commit point
    shutil.rmtree(trash, ignore_errors=True)


# -- loading ---------------------------------------------------------------------------------------


@dataclass
class _LoadPlan:
    """Everything one rank will set, planned and checked before anything in the engine changes; the
    units' values are read later, one unit at a time ([Note: streaming checkpoints] in units.py)."""

    meta: dict
    files: fmt.CheckpointFiles
    units: list[cu.UnitLoad] = field(default_factory=list)
    module_states: dict[str, torch.Tensor] = field(default_factory=dict)
    rng: Optional[dict] = None
    client_state: dict = field(default_factory=dict)
    lr_scheduler: Optional[dict] = None


class Resumed(NamedTuple):
    """What a load read for the engine to apply itself (`ZeroEngine.load_checkpoint`): checkpoints set the units'
    values and the model's buffers through the seams, and never the engine's own state."""

    client_state: dict
    counters: dict                # global_step, micro_step, skipped_steps, gradient_accumulation_steps
    loss_scaler: dict             # LossScaler.state_dict()
    lr_scheduler: Optional[dict]  # None: none saved, or not asked for
    rng: Optional[dict]           # this rank's RNG states (None: a rank beyond the saved world size)


def read_checkpoint(engine: CheckpointEngine, load_dir, tag: Optional[str] = None,
                    load_lr_scheduler: bool = True) -> Resumed:
    """Load a checkpoint saved at any world size or stage into `engine`'s units, module and optimizer groups,
    and return what the engine applies itself. Call `engine.load_checkpoint`, which does both.

    Every rank must call it. On an error found while planning (raised as CheckpointError on every
    rank) the engine and the checkpoint are left unchanged; see the module docstring.
    """
    plan, error = None, None
    try:
        plan = _prepare_load(engine, load_dir, tag)
        if not load_lr_scheduler:
            plan.lr_scheduler = None
    except Exception as err:  # agreed on below: either every rank applies, or none does
        error = err
    _agree(engine, error, "could not load the checkpoint")
    error = None
    try:
        _load_units(engine, plan)
    except Exception as err:  # agreed on below, so no rank goes on to re-assemble after a failed one
        error = err
    _agree(engine, error, "failed while reading the checkpoint's values",
           note="; the engine now holds a mix of its old and the loaded states: load a checkpoint again before "
                "training")
    _apply_load(engine, plan)
    plan.files.close()
    return Resumed(plan.client_state, plan.meta["counters"], plan.meta["loss_scaler"], plan.lr_scheduler, plan.rng)


def _agree(engine: CheckpointEngine, error: Optional[Exception], what: str, note: str = "") -> None:
    """Raise on every rank if any rank failed (note: a collective); `note` is added to the message."""
    messages = comm.all_gather_object(None if error is None else _message(error), engine.process_group)
    if error is not None:
        if isinstance(error, CheckpointError) and not note:
            raise error
        raise CheckpointError(_message(error) + note) from error
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        rank, msg = failed[0]
        raise CheckpointError(f"rank {rank} {what}: {msg}{note}")


def _message(error: Exception) -> str:
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


def checkpoint_tag_dir(load_dir, tag: Optional[str] = None) -> Path:
    """The folder of the checkpoint a load of (load_dir, tag) reads: a DeepSpeed tag folder, or zerodp's."""
    ds_dir = deepspeed_tag_dir(Path(load_dir), tag)
    return ds_dir if ds_dir is not None else fmt.resolve_tag_dir(load_dir, tag)


def _open(engine: CheckpointEngine, load_dir, tag: Optional[str]) -> tuple[dict, fmt.CheckpointFiles]:
    """meta.json and the files of the checkpoint to load: zerodp's own, or DeepSpeed's read as one (a ZeRO or
    universal folder: checkpoint/deepspeed_reader.py)."""
    ds_dir = deepspeed_tag_dir(Path(load_dir), tag)
    if ds_dir is not None:
        return as_zerodp(ds_dir, read_deepspeed(ds_dir), engine, LR_SCHEDULER_FILE)
    tag_dir = fmt.resolve_tag_dir(load_dir, tag)
    meta = fmt.read_meta(tag_dir)
    return meta, fmt.CheckpointFiles(tag_dir, meta)


def _prepare_load(engine: CheckpointEngine, load_dir, tag: Optional[str]) -> _LoadPlan:
    meta, files = _open(engine, load_dir, tag)
    tag_dir = files.tag_dir
    current = cs.describe_tensors(engine)
    cs.check_same_model(meta["tensors"], current, tag_dir)
    cls, larc = cs.optimizer_class(engine)
    saved_cls, saved_larc = meta["optimizer"]["class"], meta["optimizer"]["larc"]
    if cls != saved_cls or (larc is None) != (saved_larc is None):
        raise CheckpointError(f"checkpoint {tag_dir} holds the state of {saved_cls}{' in LARC' * bool(saved_larc)}, "
                              f"but the engine's optimizer is {cls}{' in LARC' * bool(larc)}; use the same "
                              f"optimizer, or load only the weights (zerodp.consolidate_checkpoint)")
    plan = _LoadPlan(meta, files, cu.plan_load(engine, meta))
    for name in sorted(cu.files_needed(plan.units)):
        files.path(name)  # exists and matches its checksum (read in blocks: nothing is held)
    sharded = {id(p) for unit, _ in cs.sharded_units(engine) for p in unit.params}
    live = engine.module.state_dict(keep_vars=True)
    for key, entry in current.items():
        if entry["kind"] != "param" and entry["alias_of"] is None and id(live[key]) not in sharded:
            shape = torch.Size(entry["shape"])
            plan.module_states[key] = files.read_value(key, 0, shape.numel()).view(shape)
    if engine.rank < meta["world_size"] and files.has(fmt.rng_file(engine.rank)):  # DeepSpeed saves no RNG state
        plan.rng = files.read_json(fmt.rng_file(engine.rank))
    if files.has(fmt.CLIENT_STATE_FILE):
        plan.client_state = files.read_torch(fmt.CLIENT_STATE_FILE)
    if files.has(LR_SCHEDULER_FILE):
        plan.lr_scheduler = files.read_torch(LR_SCHEDULER_FILE)
    return plan


def _load_units(engine: CheckpointEngine, plan: _LoadPlan) -> None:
    """Masters, optimizer state and frozen shards, one unit at a time (nothing else is held)."""
    for load in plan.units:
        cu.load_unit(engine, load, plan.files)


@torch.no_grad()
def _apply_load(engine: CheckpointEngine, plan: _LoadPlan) -> None:
    """The model's and the optimizer's parts beside the units' values: hyper-parameters and buffers. What the
    engine owns (scaler, schedule, counters, RNG, re-assembling the parameters) it applies from `Resumed`."""
    meta = plan.meta
    for user, group in cs.inner_groups(engine):
        saved = meta["optimizer"]["groups"].get(str(user), {})
        group.update({k: cs.decode_hyper(v) for k, v in saved.items() if k in group})
    live = engine.module.state_dict(keep_vars=True)
    for key, value in plan.module_states.items():
        live[key].data.copy_(value)
    # after the units' states (their chunk counts): a checkpoint from before per-parameter counts has none, and
    # then every parameter takes its chunk's count, which is what it stepped with then
    saved = meta.get("param_steps")
    names = cs.canonical_names(engine)
    engine.optimizer.load_param_steps(None if saved is None else
                                      {pid: saved[name] for pid, name in names.items() if name in saved})


# -- small collectives -------------------------------------------------------------------------------


def _run_on_rank0(engine: CheckpointEngine, what: str, fn) -> None:
    """Run `fn` on rank 0 and raise its failure on every rank (no rank proceeds alone)."""
    error = None
    if engine.rank == 0:
        try:
            fn()
        except Exception as err:
            error = err
    messages = comm.all_gather_object(None if error is None else _message(error), engine.process_group)
    if messages[0] is not None:
        raise CheckpointError(f"rank 0 could not {what}: {messages[0]}") from error
