"""Full (unsharded) fp32 state dicts: from a checkpoint on disk, or gathered from a live engine.

`consolidate_checkpoint(dir)` needs no process group and no GPU: it reads meta.json and stitches
each trainable parameter together from the saved segments of every rank file (each verified
against its sha256). `full_state_dict(engine)` gathers a live engine's fp32 masters unit by unit,
keeping the result on rank 0 only (other ranks hold one staging buffer of at most
`allgather_bucket_size` elements at a time, never a full copy).

`save_consolidated(dir, out)` writes it to disk without building it: a folder in the Hugging Face
layout or one *.safetensors file, streamed (hf_export.py), or torch.save (*.pt, in memory).

Both dicts hold model.state_dict()'s keys in its order: trainable parameters as fp32, frozen parameters
and floating buffers upcast to fp32, integer buffers as saved. A tied parameter appears under every
name as one tensor object, so `model.load_state_dict(sd, strict=True)` works on the plain model.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Mapping, Optional

import torch

from .. import comm
from ..errors import CheckpointError
from ..comm import chunk_ranges
from ..shard.seams import CheckpointEngine
from . import format as fmt
from .hf_export import DEFAULT_MAX_SHARD_SIZE, export_hf, export_safetensors_file
from .state import canonical_names, describe_tensors, sharded_units
from .tensor_parallel import read_layout, saved_tp_size, tp_dir
from ..tensor_parallel.layout import ShardSpec, merge_state_dicts


def consolidate_checkpoint(ckpt_dir, tag: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of checkpoint `tag` (default: the latest) in `ckpt_dir`, on CPU."""
    tag_dir = fmt.resolve_tag_dir(ckpt_dir, tag)
    meta = fmt.read_meta(tag_dir)
    files = fmt.CheckpointFiles(tag_dir, meta)
    out: dict[str, torch.Tensor] = OrderedDict()
    for key, entry in meta["tensors"].items():
        if entry["alias_of"] is not None:
            out[key] = out[entry["alias_of"]]  # a tied tensor: the same object under every name
            continue
        shape = torch.Size(entry["shape"])
        out[key] = _upcast(files.read_value(key, 0, shape.numel()).view(shape))
    files.close()
    return out


FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


def consolidate_tensor_parallel(root, specs: Optional[Mapping[str, ShardSpec]] = None,
                                tag: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The unsharded fp32 state dict of checkpoint `tag` saved under `root` by every tensor-parallel rank,
    merged by `specs` ({name: ShardSpec}; default: the layout recorded at save time). Holds every tensor-parallel
    rank's state dict in memory at once."""
    size = saved_tp_size(root)
    if size is None:
        raise CheckpointError(f"{root} has no tensor-parallel checkpoint (tp-XX-of-YY directories)")
    specs = read_layout(root) if specs is None else specs
    per_rank = [consolidate_checkpoint(tp_dir(root, t, size), tag) for t in range(size)]
    return merge_state_dicts(per_rank, specs)


def output_layout(out_path) -> str:
    """How `out_path` is written: "hf" (a folder, the Hugging Face layout: an existing directory, or a
    name without a suffix), "safetensors" (one file, streamed) or "torch" (torch.save, *.pt/.pth/.bin)."""
    out = Path(out_path)
    if out.is_dir() or (out.suffix == "" and not out.exists()) or str(out_path).endswith(os.sep):
        return "hf"
    if out.suffix == ".safetensors":
        return "safetensors"
    if out.suffix in FILE_SUFFIXES:
        return "torch"
    raise CheckpointError(f"cannot tell the format of {out}: give a folder (Hugging Face layout: sharded "
                          f"model-*.safetensors + index), or name a file *.safetensors, or *.pt/.pth/.bin for "
                          f"torch.save")


def save_consolidated(ckpt_dir, out_path, tag: Optional[str] = None, max_shard_size=None,
                      config_json=None) -> Path:
    """Write checkpoint `tag` (default: the latest) of `ckpt_dir` to `out_path` (see `output_layout`).

    A folder gets the Hugging Face layout (`hf_export.export_hf`: shards of at most `max_shard_size`,
    default 5GB, and `config_json` copied beside them); a *.safetensors file is one streamed file. Both
    hold one piece of a tensor at a time, never the model. *.pt/.pth/.bin (torch.save) needs the whole
    state dict in memory. Returns `out_path`.
    """
    layout = output_layout(out_path)
    if saved_tp_size(ckpt_dir) is not None:  # per tensor-parallel rank: merged into the unsharded model
        if layout == "hf" or max_shard_size is not None or config_json is not None:
            raise CheckpointError(f"{ckpt_dir} holds a tensor-parallel checkpoint, merged into one file: name OUT "
                                  f"*.safetensors or *.pt (no folder layout, shard size or config)")
        write_state_dict(consolidate_tensor_parallel(ckpt_dir, tag=tag), out_path)
        return Path(out_path)
    if layout != "hf" and (max_shard_size is not None or config_json is not None):
        raise CheckpointError(f"a shard size and a model config apply to a folder output; {out_path} is a file "
                              f"(drop the suffix to get the Hugging Face layout)")
    if layout == "hf":
        export_hf(ckpt_dir, out_path, tag, max_shard_size or DEFAULT_MAX_SHARD_SIZE, config_json)
    elif layout == "safetensors":
        export_safetensors_file(ckpt_dir, out_path, tag)
    else:
        write_state_dict(consolidate_checkpoint(ckpt_dir, tag), out_path)
    return Path(out_path)


def write_state_dict(state: dict[str, torch.Tensor], out_path) -> Path:
    """Save a full state dict atomically (a temporary name, then a rename): *.safetensors or torch.save."""
    out = Path(out_path)
    if out.suffix not in FILE_SUFFIXES:
        raise CheckpointError(f"cannot tell the format of {out}: name it *.safetensors, or *.pt/.pth/.bin "
                              f"for torch.save")
    if out.is_dir():
        raise CheckpointError(f"{out} is a directory; give a file name")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        # safetensors refuses tensors that share storage, so every alias of a tied weight gets a copy
        seen: set[int] = set()
        tensors = {}
        for key, t in state.items():
            tensors[key] = t.clone() if id(t) in seen else t.contiguous()
            seen.add(id(t))
        save_file(tensors, str(tmp), metadata={"format": "pt", "producer": "zerodp"})
    else:
        torch.save(state, tmp)
    os.replace(tmp, out)
    return out


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


def consolidate_main(argv: Optional[list[str]] = None) -> int:
    """`zerodp consolidate CKPT_DIR OUT [--tag T] [--max-shard-size S] [--config C]`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="zerodp consolidate", description=CLI_DESCRIPTION)
    add_consolidate_arguments(parser)
    args = parser.parse_args(argv)
    try:
        out = save_consolidated(args.ckpt_dir, args.out, args.tag, args.max_shard_size, args.config)
    except (CheckpointError, OSError) as err:
        print(f"zerodp consolidate: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    if out.is_dir():
        weights = sorted(p.name for p in out.glob("model*.safetensors"))
        what = f"{len(weights)} weight file{'s' if len(weights) > 1 else ''}" + \
            (" + model.safetensors.index.json" if len(weights) > 1 else "")
    else:
        what = f"{out.stat().st_size / 2**20:,.1f} MiB"
    print(f"zerodp consolidate: wrote {out} ({what})")
    return 0


CLI_DESCRIPTION = ("Read the per-rank shards a run saved under CKPT_DIR (any stage, any world size; no GPU, no "
                   "process group) and write the full fp32 model to OUT, loadable without zerodp. OUT a folder: "
                   "the Hugging Face layout (model.safetensors, or model-0000k-of-0000n.safetensors shards and "
                   "model.safetensors.index.json; a tied weight written once, as save_pretrained does), streamed "
                   "one piece of a tensor at a time; OUT *.safetensors: one file, streamed, every tied name kept; "
                   "OUT *.pt/*.pth/*.bin: torch.save of the state dict (holds the whole model in memory).")


def add_consolidate_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `zerodp consolidate` (shared by consolidate_main and the zerodp command)."""
    parser.add_argument("ckpt_dir", metavar="CKPT_DIR", help="the folder given to engine.save_checkpoint "
                        "(e.g. runs/X/checkpoints)")
    parser.add_argument("out", metavar="OUT", help="a folder (Hugging Face layout), or a file: *.safetensors, "
                        "or *.pt / *.pth / *.bin for torch.save")
    parser.add_argument("--tag", metavar="T", default=None, help="which checkpoint under CKPT_DIR (default: the "
                        "one named in 'latest')")
    parser.add_argument("--max-shard-size", metavar="S", default=None, help="folder output: the most bytes per "
                        "weight file, e.g. 5GB, 500MB, 2GiB (default 5GB, transformers 4.x's save_pretrained "
                        "default); a tensor bigger than S gets a file of its own")
    parser.add_argument("--config", metavar="C", default=None, help="folder output: the model's config.json (or "
                        "a folder holding one), copied to OUT/config.json so from_pretrained(OUT) needs nothing "
                        "else; without it, copy config.json into OUT yourself")


# -- a live engine ---------------------------------------------------------------------------------


@torch.no_grad()
def full_state_dict(engine: CheckpointEngine, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The engine's full fp32 state dict on CPU; every rank must call it. Empty on ranks > 0 if rank0_only."""
    keep = engine.rank == 0 or not rank0_only
    chunk_numel = engine.config.zero_optimization.allgather_bucket_size
    names = canonical_names(engine)
    gathered: dict[str, torch.Tensor] = {}
    for unit, master in sharded_units(engine):
        source = master if master is not None else unit.param_shard  # frozen units (stage 3) have no master
        # masters may live on the host (ZeRO-Offload) while the group's collectives run on the model's device
        flat = gather_flat(unit.layout, source, engine.sharding.state_group, chunk_numel, keep,
                           device=engine.placement.compute.device)
        if keep:
            for p, offset, numel, shape in zip(unit.params, unit.layout.offsets, unit.layout.numels,
                                               unit.layout.shapes):
                gathered[names[id(p)]] = flat[offset:offset + numel].view(shape).clone()
    if not keep:
        return {}
    live = engine.module.state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = OrderedDict()
    for key, entry in describe_tensors(engine).items():
        if entry["alias_of"] is not None:
            out[key] = out[entry["alias_of"]]
        elif key in gathered:
            out[key] = gathered[key]
        else:  # buffers and frozen parameters every rank holds whole
            out[key] = _upcast(live[key].detach().cpu().clone())
    return out


def gather_flat(layout, shard: torch.Tensor, group, chunk_numel: int, keep: bool,
                device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
    """The unit's whole flat buffer as fp32 on CPU where `keep`, from every rank's shard. `device`: where the
    group's collectives run (NCCL: the GPU, while a host master is on the CPU); None: the shard's device."""
    if layout.num_shards == 1:
        return shard.detach().float().cpu().clone() if keep else None
    device = shard.device if device is None else device
    if not layout.even_shards:
        return _gather_uneven(layout, shard, group, chunk_numel, keep, device)
    world, shard_numel = layout.num_shards, layout.shard_numel
    out = torch.empty(layout.padded_numel, dtype=torch.float32) if keep else None
    per_rank = max(1, min(shard_numel, chunk_numel // world))
    staging = torch.empty(world * per_rank, dtype=shard.dtype, device=device)
    for lo in range(0, shard_numel, per_rank):  # the staging buffer bounds memory on every rank
        hi = min(lo + per_rank, shard_numel)
        part = staging[:world * (hi - lo)]
        comm.all_gather(part, shard.detach()[lo:hi].to(device), group, tag="checkpoint")
        if keep:
            out.view(world, shard_numel)[:, lo:hi].copy_(part.view(world, hi - lo))
    return out


def _gather_uneven(layout, shard: torch.Tensor, group, chunk_numel: int, keep: bool,
                   device: torch.device) -> Optional[torch.Tensor]:
    """`gather_flat` for shards of unequal sizes: each owner broadcasts its shard, `chunk_numel` at a time."""
    out = torch.empty(layout.padded_numel, dtype=torch.float32) if keep else None
    staging = torch.empty(max(1, min(chunk_numel, layout.shard_numel)), dtype=shard.dtype, device=device)
    mine = comm.get_rank(group)
    for r, (start, end) in enumerate(layout.shard_ranges()):
        for lo, hi in chunk_ranges(end - start, staging.numel()):
            part = staging[:hi - lo]
            if r == mine:
                part.copy_(shard.detach()[lo:hi])
            comm.broadcast(part, r, group, tag="checkpoint")
            if keep:
                out[start + lo:start + hi].copy_(part)
    return out
