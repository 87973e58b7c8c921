"""Streaming consolidation: a zerodp checkpoint written as Hugging Face safetensors, piece by piece.

    OUT/model.safetensors                              the whole model, when it fits in one shard
    OUT/model-00001-of-0000N.safetensors ...           otherwise, shards of at most max_shard_bytes
    OUT/model.safetensors.index.json                   {"metadata": {"total_size", "total_parameters"},
                                                        "weight_map": {tensor name: shard file}}
    OUT/config.json                                    copied when a model config is given

This is the layout `transformers`' save_pretrained writes and from_pretrained / safetensors read
unchanged. The values are those of `consolidate_checkpoint`: floating tensors in fp32 (the masters),
integer buffers as saved. A tied parameter is written once, under its first state_dict name, as
save_pretrained does (it drops the tied copy, e.g. GPT-2's lm_head.weight, and from_pretrained ties
it again); a single-file export (`export_safetensors_file`) keeps every name instead, so a plain
`model.load_state_dict(strict=True)` finds them all.

Memory: a safetensors header needs only names, dtypes and shapes, which meta.json has, so each file's
header is written first and the values follow in `piece_bytes` pieces, each read from the rank file
that holds it (`CheckpointFiles.iter_value`, plain preads, no mapping), upcast, written and dropped.
Peak RSS above the interpreter is one piece (and the piece as read, when a bf16/fp16 tensor is
upcast), whatever the size of the model or of its largest tensor (bench/results/consolidate_rss.md). Shards are split in
state_dict order: a new file starts when the next tensor would take the current one past
max_shard_bytes, and a tensor bigger than that gets a file of its own (as save_pretrained does).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from ..errors import CheckpointError
from . import format as fmt

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers 4.x save_pretrained's default (5.x raised it to 50GB)
DEFAULT_PIECE_BYTES = 32 * 2**20
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class ExportedTensor(NamedTuple):
    """One tensor of the output: its name there, the checkpoint tensor that holds its values, dtype, shape."""

    key: str
    source: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


class ExportResult(NamedTuple):
    files: list[Path]         # the weight files written, in order
    tensors: int              # tensors written (tied copies dropped in the directory layout)
    total_bytes: int          # their bytes, as the index's total_size


def parse_size(text) -> int:
    """Bytes from "5GB" (10^9), "500MB", "2GiB" (2^30), "123" (bytes) or an int, as save_pretrained reads them."""
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not match or match.group(2).upper() not in _SIZE_UNITS:
            raise CheckpointError(f"cannot read the size {text!r}: write a number with a unit, e.g. 5GB, 500MB, "
                                  f"2GiB (KB/MB/GB/TB are powers of 10, KiB/MiB/GiB/TiB powers of 2), or bytes")
        value, unit = float(match.group(1)), match.group(2).upper()
    nbytes = int(value * _SIZE_UNITS[unit])
    if nbytes <= 0:
        raise CheckpointError(f"the size {text!r} must be positive")
    return nbytes


def exported_tensors(meta: dict, keep_aliases: bool) -> list[ExportedTensor]:
    """The output's tensors in state_dict order; tied copies dropped unless `keep_aliases`."""
    out = []
    for key, entry in meta["tensors"].items():
        if entry["alias_of"] is not None and not keep_aliases:
            continue
        dtype = getattr(torch, entry["dtype"])
        out.append(ExportedTensor(key, entry["alias_of"] or key, torch.float32 if dtype.is_floating_point else dtype,
                                  tuple(entry["shape"])))
    return out


def plan_shards(tensors: list[ExportedTensor], max_shard_bytes: int) -> list[list[ExportedTensor]]:
    """Consecutive groups of `tensors`, each at most max_shard_bytes unless one tensor alone is bigger."""
    shards: list[list[ExportedTensor]] = [[]]
    filled = 0
    for t in tensors:
        if shards[-1] and filled + t.nbytes > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(t)
        filled += t.nbytes
    return shards


def export_hf(ckpt_dir, out_dir, tag: Optional[str] = None, max_shard_size="5GB", config_json=None,
              piece_bytes: int = DEFAULT_PIECE_BYTES) -> ExportResult:
    """Write checkpoint `tag` (default: the latest) of `ckpt_dir` into directory `out_dir` in the
    Hugging Face layout (module docstring); `config_json`, a config.json file or a folder holding one,
    is copied beside the weights. Weight files a previous export left there are replaced or removed."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir} is a file; give a directory for the Hugging Face layout, or name the "
                              f"output *.safetensors for one file")
    config_text = _read_config(config_json) if config_json is not None else None
    max_shard_bytes = parse_size(max_shard_size)
    tag_dir = fmt.resolve_tag_dir(ckpt_dir, tag)
    meta = fmt.read_meta(tag_dir)
    tensors = exported_tensors(meta, keep_aliases=False)
    shards = plan_shards(tensors, max_shard_bytes)
    names = [SINGLE_FILE] if len(shards) == 1 else \
        [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    out_dir.mkdir(parents=True, exist_ok=True)
    files = fmt.CheckpointFiles(tag_dir, meta)
    try:
        for name, shard in zip(names, shards):
            _write_file(out_dir / name, shard, files, piece_bytes)
    finally:
        files.close()
    total_bytes = sum(t.nbytes for t in tensors)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes,
                              "total_parameters": sum(torch.Size(t.shape).numel() for t in tensors)},
                 "weight_map": {t.key: name for name, shard in zip(names, shards) for t in shard}}
        fmt.write_text_atomically(out_dir / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True) + "\n")
    if config_text is not None:
        fmt.write_text_atomically(out_dir / CONFIG_FILE, config_text)
    _remove_stale_weights(out_dir, set(names) | ({INDEX_FILE} if len(shards) > 1 else set()))
    return ExportResult([out_dir / n for n in names], len(tensors), total_bytes)


def export_safetensors_file(ckpt_dir, out_path, tag: Optional[str] = None,
                            piece_bytes: int = DEFAULT_PIECE_BYTES) -> ExportResult:
    """Write checkpoint `tag` of `ckpt_dir` as one safetensors file `out_path`, streamed like `export_hf`;
    every name of a tied tensor is kept (its values written once per name)."""
    tag_dir = fmt.resolve_tag_dir(ckpt_dir, tag)
    meta = fmt.read_meta(tag_dir)
    tensors = exported_tensors(meta, keep_aliases=True)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    files = fmt.CheckpointFiles(tag_dir, meta)
    try:
        _write_file(Path(out_path), tensors, files, piece_bytes)
    finally:
        files.close()
    return ExportResult([Path(out_path)], len(tensors), sum(t.nbytes for t in tensors))


def _write_file(path: Path, tensors: list[ExportedTensor], files: fmt.CheckpointFiles, piece_bytes: int) -> None:
    """One safetensors file: the header from the shapes, then each tensor's pieces as they are read.
    Written under a temporary name and renamed, so a crash never leaves a half file under the real one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        # "format": "pt" is what from_pretrained checks before it reads a safetensors file
        f.write(fmt.safetensors_header([(t.key, t.dtype, t.shape) for t in tensors],
                                       {"format": "pt", "producer": "zerodp"}))
        for t in tensors:
            written = 0
            # counted in the output dtype: a piece is at most piece_bytes once upcast (a bf16 piece is half that)
            max_numel = max(1, piece_bytes // t.dtype.itemsize)
            for piece in files.iter_value(t.source, 0, torch.Size(t.shape).numel(), max_numel):
                piece = piece.to(t.dtype).contiguous()
                f.write(fmt.tensor_bytes(piece))
                written += piece.numel()
                # dropped before the next piece is read: otherwise two pieces are alive at the peak
                del piece
            if written != torch.Size(t.shape).numel():
                raise CheckpointError(f"the checkpoint holds {written} elements of {t.source!r}, its metadata says "
                                      f"{torch.Size(t.shape).numel()}; the checkpoint is inconsistent")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_config(config_json) -> str:
    path = Path(config_json)
    if path.is_dir():
        path = path / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"model config {path} not found: give the model's config.json (or the folder "
                              f"holding it), e.g. from model.config.save_pretrained(folder)")
    text = path.read_text()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"model config {path} is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"model config {path} is not a JSON object; give a Hugging Face config.json")
    return text


def _remove_stale_weights(out_dir: Path, keep: set[str]) -> None:
    """Remove weight files of an earlier export into the same folder (another shard count), as
    save_pretrained does, so from_pretrained never reads a mix; other files are left alone."""
    for p in out_dir.iterdir():
        if p.name in keep or not p.is_file():
            continue
        if p.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.fullmatch(p.name):
            p.unlink()
