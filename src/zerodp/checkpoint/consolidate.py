"""Full (unsharded) fp32 state dicts: from a checkpoint on disk, or gathered from a live engine.

`consolidate_checkpoint(dir)` needs no process group and no GPU: it reads meta.json and stitches
each trainable parameter together from the saved segments of every rank file (each verified
against its sha256). `full_state_dict(engine)` gathers a live engine's fp32 masters unit by unit,
keeping the result on rank 0 only (other ranks hold one staging buffer of at most
`allgather_bucket_size` elements at a time, never a full copy).

Both return model.state_dict()'s keys in its order: trainable parameters as fp32, frozen parameters
and floating buffers upcast to fp32, integer buffers as saved. A tied parameter appears under every
name as one tensor object, so `model.load_state_dict(sd, strict=True)` works on the plain model.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import torch

from .. import comm
from ..errors import CheckpointError
from ..comm import chunk_ranges
from ..seams import CheckpointEngine
from . import format as fmt
from .state import canonical_names, describe_tensors, sharded_units


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


def save_consolidated(ckpt_dir, out_path, tag: Optional[str] = None) -> Path:
    """Write `consolidate_checkpoint(ckpt_dir, tag)` to out_path: .safetensors, or .pt/.pth/.bin (torch.save)."""
    return write_state_dict(consolidate_checkpoint(ckpt_dir, tag), out_path)


def write_state_dict(state: dict[str, torch.Tensor], out_path) -> Path:
    """Save a full state dict atomically (a temporary name, then a rename)."""
    out = Path(out_path)
    if out.suffix not in (".safetensors", ".pt", ".pth", ".bin"):
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
    """`zerodp consolidate CKPT_DIR OUT [--tag TAG]`; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="zerodp consolidate",
        description="Build the full fp32 model state dict from a zerodp checkpoint (no GPU, no process group).")
    parser.add_argument("ckpt_dir", help="the directory given to engine.save_checkpoint")
    parser.add_argument("out", help="output file: *.safetensors, or *.pt / *.pth / *.bin for torch.save")
    parser.add_argument("--tag", default=None, help="which checkpoint (default: the one named in 'latest')")
    args = parser.parse_args(argv)
    try:
        state = consolidate_checkpoint(args.ckpt_dir, args.tag)
        out = write_state_dict(state, args.out)
    except (CheckpointError, OSError) as err:
        print(f"zerodp consolidate: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    numel = sum(t.numel() for t in {id(t): t for t in state.values()}.values())
    print(f"zerodp consolidate: wrote {out} ({len(state)} tensors, {numel:,} elements)")
    return 0


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
        flat = gather_flat(unit.layout, source, engine.sharding.state_group, chunk_numel, keep)
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


def gather_flat(layout, shard: torch.Tensor, group, chunk_numel: int, keep: bool) -> Optional[torch.Tensor]:
    """The unit's whole flat buffer as fp32 on CPU where `keep`, from every rank's shard."""
    if layout.num_shards == 1:
        return shard.detach().float().cpu().clone() if keep else None
    if not layout.even_shards:
        return _gather_uneven(layout, shard, group, chunk_numel, keep)
    world, shard_numel = layout.num_shards, layout.shard_numel
    out = torch.empty(layout.padded_numel, dtype=torch.float32) if keep else None
    per_rank = max(1, min(shard_numel, chunk_numel // world))
    staging = torch.empty(world * per_rank, dtype=shard.dtype, device=shard.device)
    for lo in range(0, shard_numel, per_rank):  # the staging buffer bounds memory on every rank
        hi = min(lo + per_rank, shard_numel)
        part = staging[:world * (hi - lo)]
        comm.all_gather(part, shard.detach()[lo:hi], group, tag="checkpoint")
        if keep:
            out.view(world, shard_numel)[:, lo:hi].copy_(part.view(world, hi - lo))
    return out


def _gather_uneven(layout, shard: torch.Tensor, group, chunk_numel: int, keep: bool) -> Optional[torch.Tensor]:
    """`gather_flat` for shards of unequal sizes: each owner broadcasts its shard, `chunk_numel` at a time."""
    out = torch.empty(layout.padded_numel, dtype=torch.float32) if keep else None
    staging = torch.empty(max(1, min(chunk_numel, layout.shard_numel)), dtype=shard.dtype, device=shard.device)
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
