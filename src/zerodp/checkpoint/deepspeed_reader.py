"""A DeepSpeed ZeRO checkpoint read as a zerodp one: `open_deepspeed` -> (meta, files) for save_load's loader.

DeepSpeed's layout (0.19.8; the one its zero_to_fp32.py documents), one tag folder per checkpoint:
    <dir>/latest                                       the newest tag ("global_step3")
    <dir>/<tag>/mp_rank_00_model_states.pt             stages 1-2: module (compute dtype), param_shapes (one ordered
                                                       {name: shape} per optimizer group), frozen_param_shapes,
                                                       frozen_param_fragments, buffer_names, shared_params,
                                                       lr_scheduler, global_steps, skipped_steps, dp_world_size,
                                                       ds_config, and the client state's keys beside them
    <dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt   stage 3: the same per rank (module holds empty params;
                                                       frozen_param_fragments holds rank r's part of each frozen one)
    <dir>/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   {"optimizer_state_dict": ...} of rank r:
      stages 1-2: single_partition_of_fp32_groups[g] (rank r's contiguous slice of group g's flat fp32 vector, the
                  group's parameters back to back in param_shapes order, each followed by its
                  param_alignment_paddings entry), base_optimizer_state {state: {g: {step, exp_avg, exp_avg_sq}},
                  param_groups}, loss_scaler, zero_stage
      stage 3:    fp32_flat_groups[g] (rank r's part of every parameter of group g, each parameter cut into
                  ceil(numel / world) pieces, the last one padded), optimizer_state_dict {state, param_groups}
Universal folders (DeepSpeed's ds_to_universal): <dir>/latest_universal, <dir>/<tag>/zero/<name>/{fp32, exp_avg,
exp_avg_sq, step}.pt (whole tensors), <tag>/zero/optimizer_state.pt (param_groups, loss scaler), and the model
states file copied from the ZeRO checkpoint.

Everything is rebuilt into whole fp32 parameters and whole optimizer state tensors, then shown to the loader as a
one-rank zerodp checkpoint held in memory (`MemoryCheckpointFiles`): the loader's resharding (units.plan_load) cuts
it for any world size and stage, as it cuts zerodp's own. Every rank reads all of DeepSpeed's files (one full copy of
the model's fp32 state per process while loading), as DeepSpeed's own universal loader does.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Optional

import torch

from . import format as fmt
from . import state as cs
from ..errors import CheckpointError
from .deepspeed_pickle import load_deepspeed_file, record_value

UNIVERSAL_LATEST = "latest_universal"
# The model-states file's own keys; everything else in it is the client state (DeepSpeed's load returns those).
_DEEPSPEED_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                   "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                   "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
                   "checkpoint_parallel_dimensions", "ds_config", "ds_version"}
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL = re.compile(r"^(zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
SHARD = fmt.shard_file(0, 1)  # the one rank file of the in-memory zerodp checkpoint


class DeepSpeedState:
    """A DeepSpeed checkpoint's contents, whole: per-parameter fp32 masters and optimizer state, the rest."""

    def __init__(self) -> None:
        self.param_groups: list[dict[str, torch.Size]] = []   # per optimizer group: {name: shape}, DeepSpeed's order
        self.masters: dict[str, torch.Tensor] = {}            # name -> whole fp32 value
        self.states: dict[str, dict[str, torch.Tensor]] = {}  # name -> {exp_avg: whole, ...}
        self.scalars: list[dict[str, Any]] = []               # per group: {"step": tensor(3.)}
        self.hyper: list[dict] = []                           # per group: lr, betas, weight_decay, ...
        self.module: dict[str, torch.Tensor] = {}             # frozen parameters and buffers, whole
        self.buffer_names: list[str] = []
        self.frozen_shapes: dict[str, torch.Size] = {}
        self.shared: dict[str, str] = {}                      # alias -> first name (tied weights)
        self.model_states: dict = {}
        self.optim_common: dict = {}                          # rank 0's optimizer_state_dict minus tensors
        self.stage = 0
        self.world_size = 1
        self.universal = False


# -- finding the files ----------------------------------------------------------------------------


def is_deepspeed_tag_dir(tag_dir: Path) -> bool:
    """A DeepSpeed ZeRO tag folder (model and optimizer files) or a universal one (zero/ inside)."""
    if not tag_dir.is_dir() or (tag_dir / fmt.META_FILE).is_file():  # zerodp's own (maybe with DeepSpeed's beside)
        return False
    names = [p.name for p in tag_dir.iterdir()]
    return any(_MODEL.match(n) for n in names) and (any(_OPTIM.match(n) for n in names) or (tag_dir / "zero").is_dir())


def deepspeed_tag_dir(ckpt_dir: Path, tag: Optional[str]) -> Optional[Path]:
    """The DeepSpeed tag folder `ckpt_dir` and `tag` name (default: `latest`, then `latest_universal`), or None when
    the folder is not DeepSpeed's. A tag folder itself is accepted too."""
    if is_deepspeed_tag_dir(ckpt_dir) and tag is None:
        return ckpt_dir
    if tag is None:
        for latest in (fmt.LATEST_FILE, UNIVERSAL_LATEST):
            if (ckpt_dir / latest).is_file():
                tag = (ckpt_dir / latest).read_text().strip()
                if is_deepspeed_tag_dir(ckpt_dir / tag):
                    return ckpt_dir / tag
        return None
    return ckpt_dir / tag if is_deepspeed_tag_dir(ckpt_dir / tag) else None


def _rank_files(tag_dir: Path, pattern: re.Pattern, rank_group: int) -> dict[int, Path]:
    out = {}
    for p in tag_dir.iterdir():
        m = pattern.match(p.name)
        if m and m.group(rank_group) is not None:
            out[int(m.group(rank_group))] = p
    return out


def _mp_ranks(tag_dir: Path) -> set[int]:
    return {int(m.group(3)) for p in tag_dir.iterdir() for m in [_MODEL.match(p.name) or _OPTIM.match(p.name)] if m}


# -- reading --------------------------------------------------------------------------------------


def read_deepspeed(tag_dir: Path) -> DeepSpeedState:
    """The whole state of DeepSpeed checkpoint folder `tag_dir` (ZeRO stages 1-3 or universal)."""
    if _mp_ranks(tag_dir) - {0}:
        raise CheckpointError(f"{tag_dir} is a DeepSpeed checkpoint with model (tensor) parallelism (mp_rank files "
                              f"beyond 00); zerodp reads data-parallel ZeRO checkpoints only: convert it with "
                              f"DeepSpeed's ds_to_universal at one model-parallel rank first")
    out = DeepSpeedState()
    model_files = _rank_files(tag_dir, _MODEL, 2)
    model_path = model_files[0] if model_files else tag_dir / "mp_rank_00_model_states.pt"
    if not model_path.is_file():
        raise CheckpointError(f"{tag_dir} is a DeepSpeed checkpoint without its model states file "
                              f"({model_path.name}); it is incomplete: copy the whole tag folder again")
    ms = load_deepspeed_file(model_path)
    out.model_states = ms
    out.param_groups = [dict(g) for g in ms.get("param_shapes") or []]
    out.frozen_shapes = dict(ms.get("frozen_param_shapes") or {})
    out.buffer_names = list(ms.get("buffer_names") or [])
    out.shared = dict(ms.get("shared_params") or {})
    out.world_size = int(ms.get("dp_world_size", 1))
    module = ms.get("module") or {}
    out.module = {k: module[k] for k in out.buffer_names if k in module}
    if not out.frozen_shapes:  # stage 1 records none: the module's other entries are the frozen parameters, whole
        trainable = {name for group in out.param_groups for name in group} | set(out.shared)
        out.frozen_shapes = {k: v.shape for k, v in module.items()
                             if k not in trainable and k not in out.module and torch.is_tensor(v) and v.numel()}
    if (tag_dir / "zero").is_dir():
        _read_universal(tag_dir, out)
    else:
        _read_zero(tag_dir, out, model_files)
    return out


def _read_universal(tag_dir: Path, out: DeepSpeedState) -> None:
    out.universal = True
    zero = tag_dir / "zero"
    common = load_deepspeed_file(zero / "optimizer_state.pt") if (zero / "optimizer_state.pt").is_file() else {}
    out.optim_common = common
    out.stage = int(record_value(common.get("zero_stage", 0)) or 0)
    out.hyper = [{k: v for k, v in g.items() if k != "params"} for g in common.get("param_groups", [])]
    for g, shapes in enumerate(out.param_groups):
        scalars = None
        for name, shape in shapes.items():
            folder = zero / name
            if not (folder / "fp32.pt").is_file():
                raise CheckpointError(f"universal checkpoint {tag_dir} has no zero/{name}/fp32.pt; it is incomplete "
                                      f"(ds_to_universal stopped early?): convert it again")
            out.masters[name] = _universal_tensor(folder / "fp32.pt").reshape(shape).float()
            out.states[name] = {}
            for f in sorted(folder.glob("*.pt")):
                key = f.stem
                if key in ("fp32", "step"):
                    continue
                out.states[name][key] = _universal_tensor(f).reshape(shape)
            if (folder / "step.pt").is_file() and scalars is None:
                scalars = {"step": _universal_tensor(folder / "step.pt")}
        out.scalars.append(scalars or {})
    for name, shape in out.frozen_shapes.items():
        out.module[name] = _universal_tensor(zero / name / "fp32.pt").reshape(shape)


def _universal_tensor(path: Path) -> torch.Tensor:
    value = load_deepspeed_file(path)
    value = value["param"] if isinstance(value, dict) else value
    return value.detach() if torch.is_tensor(value) else torch.tensor(value)


def _read_zero(tag_dir: Path, out: DeepSpeedState, model_files: dict[int, Path]) -> None:
    optim_files = _rank_files(tag_dir, _OPTIM, 2)
    world = out.world_size
    missing = [r for r in range(world) if r not in optim_files]
    if missing:
        raise CheckpointError(f"DeepSpeed checkpoint {tag_dir} was saved by {world} ranks but the optimizer files of "
                              f"ranks {missing} (zero_pp_rank_<r>_mp_rank_00_optim_states.pt) are missing: it is "
                              f"incomplete (a save that died, or a partial copy); use a complete checkpoint")
    ranks = [load_deepspeed_file(optim_files[r])["optimizer_state_dict"] for r in range(world)]
    first = ranks[0]
    out.stage = int(record_value(first.get("zero_stage", 0)))
    out.optim_common = {k: v for k, v in first.items() if not _holds_tensors(v)}
    if out.stage >= 3:
        _merge_stage3(out, ranks, model_files)
    else:
        _merge_stage12(out, ranks)


def _holds_tensors(value) -> bool:
    if torch.is_tensor(value):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    return False


def _elementwise(state: dict, numel: int) -> tuple[dict, dict]:
    tensors = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() == 1 and v.numel() == numel}
    return tensors, {k: v for k, v in state.items() if k not in tensors}


def _merge_stage12(out: DeepSpeedState, ranks: list[dict]) -> None:
    """Stages 1-2: each group's flat vector is the ranks' slices back to back."""
    base = ranks[0]["base_optimizer_state"]
    base_groups = base["param_groups"] if isinstance(base, dict) else []
    out.hyper = [{k: v for k, v in g.items() if k != "params"} for g in base_groups]
    paddings = ranks[0].get("param_alignment_paddings")
    for g, shapes in enumerate(out.param_groups):
        flat = torch.cat([r["single_partition_of_fp32_groups"][g].float() for r in ranks])
        per_rank = [_group_state(r["base_optimizer_state"], g) for r in ranks]
        tensors, scalars = _elementwise(per_rank[0], ranks[0]["single_partition_of_fp32_groups"][g].numel())
        states = {k: torch.cat([s[k] for s in per_rank]) for k in tensors}
        out.scalars.append(scalars)
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            if offset + numel > flat.numel():
                raise CheckpointError(f"DeepSpeed checkpoint: group {g}'s flat vector ({flat.numel()} elements) is "
                                      f"shorter than its parameters; the files do not belong together")
            out.masters[name] = flat[offset:offset + numel].view(shape).clone()
            out.states[name] = {k: v[offset:offset + numel].view(shape).clone() for k, v in states.items()}
            offset += numel + (paddings[g][i] if paddings else 0)
    for name, shape in out.frozen_shapes.items():  # whole at stages 1-2
        value = (out.model_states.get("frozen_param_fragments") or {}).get(name)
        if value is None:
            value = out.model_states["module"][name]
        out.module[name] = value.reshape(shape)


def _group_state(base, g: int) -> dict:
    """Group g's optimizer state: {"state": {g: ...}} (a torch state dict over flat groups) or a list per group."""
    if isinstance(base, dict):
        return base["state"].get(g, {})
    return base[g]


def _merge_stage3(out: DeepSpeedState, ranks: list[dict], model_files: dict[int, Path]) -> None:
    """Stage 3: each parameter is cut into ceil(numel / world) elements per rank, in group order."""
    world = len(ranks)
    inner = ranks[0]["optimizer_state_dict"]
    out.hyper = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
    for g, shapes in enumerate(out.param_groups):
        parts = [r["fp32_flat_groups"][g].float() for r in ranks]
        per_rank = [r["optimizer_state_dict"]["state"].get(g, {}) for r in ranks]
        tensors, scalars = _elementwise(per_rank[0], parts[0].numel())
        out.scalars.append(scalars)
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            piece = math.ceil(numel / world)

            def whole(pieces):
                return torch.cat([p[offset:offset + piece] for p in pieces])[:numel].view(shape).clone()

            out.masters[name] = whole(parts)
            out.states[name] = {k: whole([s[k] for s in per_rank]) for k in tensors}
            offset += piece
    if out.frozen_shapes:
        fragments = [load_deepspeed_file(model_files[r])["frozen_param_fragments"] for r in range(world)]
        for name, shape in out.frozen_shapes.items():
            out.module[name] = torch.cat([f[name].reshape(-1) for f in fragments])[:math.prod(shape)].view(shape)


# -- shown as a zerodp checkpoint -------------------------------------------------------------------


class MemoryTensorFile:
    """`TensorFileReader`'s reads over tensors held in memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def read(self, key: str, lo: int, hi: int) -> torch.Tensor:
        if key not in self.tensors:
            raise CheckpointError(f"the DeepSpeed checkpoint has no tensor {key!r}")
        return self.tensors[key].reshape(-1)[lo:hi].clone()

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def close(self) -> None:
        pass


class MemoryCheckpointFiles(fmt.CheckpointFiles):
    """A zerodp checkpoint's files held in memory: `SHARD` (masters and optimizer state by name, whole), the
    model-states file (frozen parameters and buffers), the client state and the lr schedule."""

    def __init__(self, tag_dir: Path, meta: dict, tensor_files: dict[str, dict], objects: dict[str, Any]) -> None:
        super().__init__(tag_dir, meta)
        self._tensor_files = {name: MemoryTensorFile(t) for name, t in tensor_files.items()}
        self._objects = objects

    def path(self, name: str) -> Path:
        if name not in self._tensor_files and name not in self._objects:
            raise CheckpointError(f"{name} is not part of the DeepSpeed checkpoint {self.tag_dir}")
        return self.tag_dir

    def has(self, name: str) -> bool:
        return name in self._tensor_files or name in self._objects

    def tensors(self, name: str) -> MemoryTensorFile:
        self.path(name)
        return self._tensor_files[name]

    def read_json(self, name: str) -> Any:
        return self._objects[name]

    def read_torch(self, name: str) -> Any:
        return self._objects[name]


ADAM_KEYS = {"exp_avg", "exp_avg_sq"}


def as_zerodp(tag_dir: Path, ds: DeepSpeedState, engine, lr_scheduler_file: str) -> tuple[dict, MemoryCheckpointFiles]:
    """meta.json and files of a one-rank zerodp checkpoint holding `ds`, for `engine`'s loader."""
    current = cs.describe_tensors(engine)
    first_of = {alias: first for alias, first in ds.shared.items()}
    group_of = {name: g for g, shapes in enumerate(ds.param_groups) for name in shapes}
    shapes = {name: list(shape) for g in ds.param_groups for name, shape in g.items()}
    tensors: dict[str, dict] = {}
    for key, entry in current.items():  # in the model's order; what the checkpoint lacks is left out (and reported)
        name = first_of.get(key, key)
        if name in group_of:
            kind, shape = "param", shapes[name]
        elif name in ds.frozen_shapes:
            kind, shape = "frozen", list(ds.frozen_shapes[name])
        elif name in ds.module:
            kind, shape = "buffer", list(ds.module[name].shape)
        else:
            continue
        tensors[key] = {"kind": kind, "shape": shape, "dtype": entry["dtype"],
                        "alias_of": first_of.get(key), "group": group_of.get(name)}
    for name in [*shapes, *ds.frozen_shapes, *ds.module]:
        if name not in tensors:
            tensors[name] = {"kind": "param" if name in shapes else "frozen" if name in ds.frozen_shapes else "buffer",
                             "shape": shapes.get(name, list(ds.frozen_shapes.get(name, ds.module.get(name, torch.empty(0)).shape))),
                             "dtype": "float32", "alias_of": None, "group": group_of.get(name)}
    cs.check_same_model(tensors, current, tag_dir)

    cls, larc = cs.optimizer_class(engine)
    state_keys = sorted({k for s in ds.states.values() for k in s})
    if set(state_keys) & ADAM_KEYS and "adam" not in cls.lower():
        raise CheckpointError(f"DeepSpeed checkpoint {tag_dir} holds Adam's moments ({', '.join(state_keys)}), but "
                              f"the engine's optimizer is {cls}; resume with an Adam(W) optimizer, or load only the "
                              f"weights (zerodp.deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint)")
    shard: dict[str, torch.Tensor] = {}
    segments, units = {}, []
    for g, names in enumerate(ds.param_groups):
        units.append({"group": g, "state_keys": sorted({k for n in names for k in ds.states[n]}),
                      "scalars": {k: cs.encode_scalar(k, v) for k, v in ds.scalars[g].items()}})
        for name in names:
            numel = ds.masters[name].numel()
            shard[fmt.tensor_key(fmt.MASTER, name, 0, numel)] = ds.masters[name].reshape(-1)
            for key, value in ds.states[name].items():
                shard[fmt.tensor_key(key, name, 0, numel)] = value.reshape(-1)
            segments[name] = [[0, 0, numel, g]]
    steps = {}
    for g, names in enumerate(ds.param_groups):
        step = ds.scalars[g].get("step")
        if step is not None:
            steps.update({name: int(float(step)) for name in names})
    ms = ds.model_states
    gas = (ms.get("ds_config") or {}).get("gradient_accumulation_steps")
    global_steps = int(ms.get("global_steps", 0))
    meta = {
        "format": "deepspeed", "version": fmt.FORMAT_VERSION, "tag": tag_dir.name, "world_size": 1,
        "stage": ds.stage, "config": ms.get("ds_config") or {},
        "counters": {"global_step": global_steps, "skipped_steps": int(ms.get("skipped_steps", 0)),
                     "micro_step": global_steps * (gas or 1), "gradient_accumulation_steps": gas or -1},
        "loss_scaler": loss_scaler_state(ds.optim_common, engine, int(ms.get("skipped_steps", 0))),
        "optimizer": {"class": cls, "larc": larc,
                      "groups": {str(g): cs.encode_hyper(h) for g, h in enumerate(ds.hyper)}},
        "tensors": tensors, "segments": segments, "units": [units], "param_steps": steps, "files": {},
    }
    objects: dict[str, Any] = {fmt.CLIENT_STATE_FILE: {k: v for k, v in ms.items() if k not in _DEEPSPEED_KEYS}}
    if ms.get("lr_scheduler") is not None:
        objects[lr_scheduler_file] = ms["lr_scheduler"]
    module = {k: v for k, v in ds.module.items() if k not in group_of}
    return meta, MemoryCheckpointFiles(tag_dir, meta, {SHARD: shard, fmt.MODEL_STATES_FILE: module}, objects)


def loss_scaler_state(optim: dict, engine, skipped_steps: int) -> dict:
    """zerodp's LossScaler state from DeepSpeed's (its LossScaler / DynamicLossScaler, read as a `DeepSpeedRecord`).

    DeepSpeed grows the scale when `cur_iter - last_overflow_iter - 1` is a positive multiple of the window at an
    update (before `cur_iter` advances); zerodp when its clean-step count, advanced first, is a multiple of it. The
    count that makes zerodp's next decision DeepSpeed's is `cur_iter - last_overflow_iter - 2`."""
    current = engine.scaler.state_dict()
    scaler = optim.get("loss_scaler")
    if not hasattr(scaler, "cur_scale"):  # a record of DeepSpeed's scaler (or zerodp's stand-in): anything else is none
        return {**current, "overflows": skipped_steps}
    state = {"scale": float(scaler.cur_scale), "hysteresis_left": current["hysteresis_left"],
             "clean_steps": 0, "overflows": skipped_steps}
    if getattr(scaler, "dynamic", False):
        state["hysteresis_left"] = int(getattr(scaler, "cur_hysteresis", current["hysteresis_left"]))
        # -1 right after an overflow: zerodp's next clean step counts 0, which grows nothing, as DeepSpeed's first
        state["clean_steps"] = int(scaler.cur_iter) - int(scaler.last_overflow_iter) - 2
    return state


def deepspeed_state_dict(tag_dir: Path, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """The fp32 state dict of a DeepSpeed checkpoint folder, as DeepSpeed's zero_to_fp32 returns it: parameters in
    fp32 (the masters), buffers and frozen parameters, tied names sharing one tensor; in the module's key order."""
    ds = read_deepspeed(tag_dir)
    values = {**{k: v for k, v in ds.module.items() if not (exclude_frozen_parameters and k in ds.frozen_shapes)},
              **ds.masters}
    values = {k: v.float() if v.is_floating_point() else v for k, v in values.items()}
    order = list(ds.model_states.get("module") or {}) or list(values)
    out = {k: values[k] for k in order if k in values}
    out.update({k: v for k, v in values.items() if k not in out})
    for alias, first in ds.shared.items():
        if first in out:
            out[alias] = out[first]
    return out
