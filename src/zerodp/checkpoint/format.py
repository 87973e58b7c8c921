"""The on-disk format of zerodp checkpoints: directory layout, tensor files, metadata and checksums.

Everything on disk is indexed by *parameter name and element range of the flattened parameter*,
never by flat-buffer offsets, world size or stage. Any later layout (another world size, another
stage, other bucket sizes) finds the slices it needs by intersecting its own ranges with the saved
ones, so resharding needs no conversion step.

    CKPT_DIR/
      latest                              the tag of the newest complete checkpoint (written last)
      <tag>/                              one complete checkpoint (a directory renamed into place)
        meta.json                         what the checkpoint holds, and the sha256 of every file below
        shard-00000-of-00002.safetensors  rank 0's slices of the fp32 masters and optimizer state (at
        shard-00001-of-00002.safetensors  stage 0, where every rank holds everything, rank 0's file only)
        rng-00000.json  rng-00001.json    each rank's RNG states (torch CPU and CUDA, python, numpy)
        model_states.safetensors          buffers and the frozen parameters every rank holds whole (rank 0)
        client_state.pt                   the user's client_state (torch.save; rank 0), when one was given
      .tmp-<tag>/                         a save in progress or one that crashed: never read, removed by
                                          the next save
      .trash-<tag>/                       the previous copy of <tag> while it is being overwritten

Keys in a shard file: "<kind>/<name>/<start>-<end>": elements [start, end) of the flattened
parameter <name> (its first name when tied); kind is "master" (fp32 weights of a trainable
parameter), "frozen" (a frozen parameter that lives in shards, stage 3; its own dtype) or the name
of an elementwise optimizer state tensor ("exp_avg", "momentum_buffer", ...). Shard files are plain
safetensors files (written here as a stream, so no slice is copied), readable by any safetensors
reader. A frozen parameter is either in segments (saved from stage 3) or whole in
model_states.safetensors (saved from stages 0-2); readers accept both.

meta.json (a JSON object):
    format, version, tag, world_size, stage, torch_version, zerodp_version, config
    counters      {global_step, micro_step, skipped_steps, gradient_accumulation_steps}
    loss_scaler   LossScaler.state_dict()
    optimizer     {class: "torch.optim.adamw.AdamW", larc: settings or null,
                   groups: {"<group index>": hyper-parameters of that optimizer param group}}
    tensors       one entry per model.state_dict() key, in its order: {kind: param | frozen | buffer,
                  shape, dtype (as the model held it), alias_of: first name of a tied tensor or null,
                  group: optimizer group index (params only)}
    segments      {param name: [[rank, start, end, unit], ...]}: which rank file holds which range
                  of each sharded parameter, and which of that rank's units it came from
    units         per rank, per saved unit: {group (-1: frozen), state_keys (elementwise optimizer
                  state tensors), scalars (other optimizer state, e.g. Adam's step: {type, dtype?,
                  value})}
    files         {file name: sha256 hex digest} for every file of the checkpoint but meta.json
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import json
import os
import struct
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Optional, Union

import torch

from ..errors import CheckpointError
from .tensor_reader import TensorFileReader

FORMAT_NAME = "zerodp-checkpoint"
FORMAT_VERSION = 1
META_FILE = "meta.json"
LATEST_FILE = "latest"
MODEL_STATES_FILE = "model_states.safetensors"
CLIENT_STATE_FILE = "client_state.pt"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
MASTER = "master"
FROZEN = "frozen"


def shard_file(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng-{rank:05d}.json"


def tensor_key(kind: str, name: str, start: int, end: int) -> str:
    return f"{kind}/{name}/{start}-{end}"


# -- writing -------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


class _HashingWriter:
    """A binary file that hashes what it writes; fsynced on close so a commit never sees half a file."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "wb")
        self.sha256 = hashlib.sha256()

    def write(self, data) -> None:
        self._file.write(data)
        self.sha256.update(data)

    def close(self) -> str:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self.sha256.hexdigest()


class TensorStream(NamedTuple):
    """Tensors declared up front and produced one at a time: a safetensors header needs every key,
    dtype and shape before the first byte, but the values need not exist together. Checkpoints
    stream a rank's shard file unit by unit this way (checkpoint/units.py)."""

    specs: list[tuple[str, torch.dtype, tuple[int, ...]]]   # (key, dtype, shape), in file order
    tensors: Iterable[tuple[str, torch.Tensor]]             # (key, value) in the same order


def write_tensor_file(path: Path, tensors: Union[Mapping[str, torch.Tensor], TensorStream],
                      metadata: Optional[dict[str, str]] = None) -> str:
    """Write `tensors` (a dict, or a `TensorStream`) as a safetensors file, streaming each one (views
    are not copied on CPU); returns the file's sha256. The format: an 8-byte little-endian header
    length, a JSON header giving each tensor's dtype, shape and byte range, then the tensors' bytes."""
    if not isinstance(tensors, TensorStream):
        tensors = TensorStream([(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], tensors.items())
    out = _HashingWriter(path)
    try:
        out.write(safetensors_header(tensors.specs, metadata))
        specs = iter(tensors.specs)
        for key, t in tensors.tensors:
            spec = next(specs, None)
            if spec is None or spec[0] != key or spec[1] != t.dtype or torch.Size(spec[2]).numel() != t.numel():
                raise CheckpointError(f"internal error: tensor {key!r} ({t.dtype}, {t.numel()} elements) does not "
                                      f"match the header's entry {spec}; the file {path} is incomplete")
            if t.numel():
                # one tensor at a time reaches the CPU, so a GPU shard is never copied whole; a copy lives
                # until written: [Note: a raw address does not own its tensor]
                out.write(tensor_bytes(t.detach().reshape(-1).contiguous().cpu()))
        missing = [spec[0] for spec in specs]
        if missing:
            raise CheckpointError(f"internal error: {len(missing)} tensors of the header of {path} were never "
                                  f"written (first: {missing[0]!r})")
    finally:
        digest = out.close()
    return digest


def safetensors_header(specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                       metadata: Optional[dict[str, str]] = None) -> bytes:
    """The bytes before the data of a safetensors file holding `specs` (key, dtype, shape) back to back
    in that order: an 8-byte little-endian length, then the JSON header, padded so the data starts
    8-byte aligned."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for key, dtype, shape in specs:
        if dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"cannot store tensor {key!r} of dtype {dtype} in a safetensors file")
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def tensor_bytes(flat: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (not .numpy(): a numpy export makes the storage
    non-resizable for good, and offloaded shards free and re-attach theirs); the view keeps `flat` alive.
    [Note: a raw address does not own its tensor] A ctypes array made `from_address` holds no reference, so
    `tensor_bytes(t.cpu())` read freed memory wherever `.cpu()` / `.contiguous()` made a new tensor (a GPU or
    strided `t`): a GPU checkpoint saved its biases as garbage its sha256 vouched for (issue 31)."""
    if flat.device.type != "cpu" or not flat.is_contiguous():
        raise ValueError(f"tensor_bytes needs a contiguous CPU tensor, not one on {flat.device} "
                         f"(contiguous: {flat.is_contiguous()}); call .contiguous().cpu() first")
    array = (ctypes.c_char * (flat.numel() * flat.element_size())).from_address(flat.data_ptr())
    array._owner = flat  # the memoryview holds the array, which now holds the tensor
    return memoryview(array)


def write_json(path: Path, obj: Any) -> str:
    """Write `obj` as indented JSON; returns the file's sha256."""
    out = _HashingWriter(path)
    try:
        out.write(json.dumps(obj, indent=1).encode())
    finally:
        digest = out.close()
    return digest


def write_torch(path: Path, obj: Any) -> str:
    """torch.save `obj`; returns the file's sha256."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    out = _HashingWriter(path)
    try:
        out.write(buffer.getbuffer())
    finally:
        digest = out.close()
    return digest


def write_text_atomically(path: Path, text: str) -> None:
    """Replace `path` by `text` in one rename: readers see the old or the new content, never half."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def validate_tag(tag: str) -> str:
    if not isinstance(tag, str) or not tag or tag.startswith(".") or "/" in tag or "\\" in tag \
            or tag == LATEST_FILE or tag != tag.strip():
        raise CheckpointError(f"invalid checkpoint tag {tag!r}: use a plain, non-empty name without '/', "
                              f"not starting with '.', and not {LATEST_FILE!r}")
    return tag


# -- finding and checking ------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def available_tags(ckpt_dir: Path) -> list[str]:
    """Tags of the complete checkpoints in `ckpt_dir` (directories with a meta.json), sorted."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p.name for p in ckpt_dir.iterdir()
                  if p.is_dir() and not p.name.startswith(".") and (p / META_FILE).is_file())


def resolve_tag_dir(ckpt_dir, tag: Optional[str] = None) -> Path:
    """The directory of checkpoint `tag` (default: the one `latest` names), or a CheckpointError."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.exists():
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist")
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir} is not a directory; pass the directory given to save_checkpoint")
    tags = available_tags(ckpt_dir)
    listing = f"available tags: {', '.join(tags)}" if tags else "it holds no complete checkpoint"
    if tag is None:
        latest = ckpt_dir / LATEST_FILE
        if not latest.is_file():
            if (ckpt_dir / META_FILE).is_file():
                return ckpt_dir  # the user passed a tag directory itself
            if not tags:
                from .folder_kind import describe_folder

                raise CheckpointError(f"{ckpt_dir} is not a zerodp checkpoint directory: {describe_folder(ckpt_dir)}")
            raise CheckpointError(f"{ckpt_dir} has no '{LATEST_FILE}' file (deleted?); name the checkpoint: "
                                  f"load_checkpoint(dir, tag=T), or --tag T with zerodp train/consolidate, for T "
                                  f"among the {listing}")
        tag = latest.read_text().strip()
    validate_tag(tag)
    tag_dir = ckpt_dir / tag
    if not (tag_dir / META_FILE).is_file():
        trash = ckpt_dir / f"{TRASH_PREFIX}{tag}"
        if (trash / META_FILE).is_file():
            return trash  # a save of the same tag died between its two renames; the old copy is whole
        if tag_dir.is_dir():  # the folder is there but is no complete zerodp checkpoint: say what it is instead
            from .folder_kind import describe_folder

            raise CheckpointError(f"checkpoint {tag!r} in {ckpt_dir} cannot be loaded: {describe_folder(tag_dir)}")
        raise CheckpointError(f"checkpoint tag {tag!r} not found in {ckpt_dir} ({listing})")
    return tag_dir


def read_meta(tag_dir: Path) -> dict:
    path = tag_dir / META_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is unreadable or truncated ({err}); the checkpoint is corrupted") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not zerodp checkpoint metadata")
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {meta.get('version')}; this zerodp reads version "
                              f"{FORMAT_VERSION}")
    return meta


class CheckpointFiles:
    """Read access to one checkpoint's files; each file's checksum is verified on first use."""

    def __init__(self, tag_dir: Path, meta: dict) -> None:
        self.tag_dir = tag_dir
        self.meta = meta
        self._verified: set[str] = set()
        self._open: dict[str, Any] = {}

    def path(self, name: str) -> Path:
        """The path of file `name`, after checking it exists and matches its recorded sha256."""
        path = self.tag_dir / name
        if name in self._verified:
            return path
        expected = self.meta["files"].get(name)
        if expected is None:
            raise CheckpointError(f"{name} is not part of checkpoint {self.tag_dir}")
        if not path.is_file():
            raise CheckpointError(f"checkpoint {self.tag_dir} is incomplete: {name} is missing")
        if sha256_file(path) != expected:
            raise CheckpointError(f"{path} is corrupted or truncated: its sha256 does not match the one "
                                  f"recorded when it was saved")
        self._verified.add(name)
        return path

    def has(self, name: str) -> bool:
        return name in self.meta["files"]

    def tensors(self, name: str) -> TensorFileReader:
        """An open reader of the tensor file `name` (slices are read on demand, never mapped)."""
        if name not in self._open:
            self._open[name] = TensorFileReader(self.path(name))
        return self._open[name]

    def read_slice(self, name: str, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the 1-D tensor `key` of file `name`, read from disk without the rest."""
        return self.tensors(name).read(key, lo, hi)

    def close(self) -> None:
        """Close the files opened for reading (also done when this object is garbage collected)."""
        for reader in self._open.values():
            reader.close()
        self._open.clear()

    def read_value(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened parameter or buffer `name` (its first name), from
        wherever the checkpoint keeps them: rank files (sharded) or the model-states file (whole)."""
        pieces = list(self.iter_value(name, start, end))
        if not pieces:
            entry = self.meta["tensors"][name]
            return torch.empty(0, dtype=torch.float32 if entry["kind"] == "param" else getattr(torch, entry["dtype"]))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def iter_value(self, name: str, start: int, end: int, max_numel: Optional[int] = None) -> Iterator[torch.Tensor]:
        """`read_value(name, start, end)` as consecutive 1-D pieces of at most `max_numel` elements,
        each read from disk when it is asked for: a consumer that writes each piece out holds one piece
        at a time, never the whole range (streaming consolidation, checkpoint/hf_export.py)."""
        entry = self.meta["tensors"][name]
        segments = self.meta["segments"].get(name)
        step = max_numel or max(1, end - start)
        if segments is None and entry["kind"] != "param":
            reader = self.tensors(MODEL_STATES_FILE)
            for lo in range(start, end, step):
                yield reader.read(name, lo, min(lo + step, end))
            return
        kind = MASTER if entry["kind"] == "param" else FROZEN
        world = self.meta["world_size"]
        for rank, s, e, _, lo, hi in overlapping(segments or [], start, end):
            for a in range(lo, hi, step):
                yield self.read_slice(shard_file(rank, world), tensor_key(kind, name, s, e), a - s, min(a + step, hi) - s)

    def read_json(self, name: str) -> Any:
        return json.loads(self.path(name).read_text())

    def read_torch(self, name: str) -> Any:
        # client_state is the user's own pickled objects (like any torch checkpoint): load trusted files only
        return torch.load(self.path(name), map_location="cpu", weights_only=False)


def overlapping(saved_segments: list, start: int, end: int) -> Iterator[tuple[int, int, int, int, int, int]]:
    """Saved pieces of one parameter that overlap its elements [start, end).

    `saved_segments` are meta.json's [rank, seg_start, seg_end, unit] entries. Yields
    (rank, seg_start, seg_end, unit, lo, hi): elements [lo, hi) of the parameter come from that
    segment; the pieces are in order and cover [start, end) exactly (an error if they do not).
    """
    covered = start
    for rank, seg_start, seg_end, unit in sorted(saved_segments, key=lambda s: s[1]):
        lo, hi = max(start, seg_start), min(end, seg_end)
        if lo >= hi:
            continue
        if lo != covered:
            break
        covered = hi
        yield rank, seg_start, seg_end, unit, lo, hi
    if covered != end:
        raise CheckpointError(f"the checkpoint's segments do not cover elements [{covered}, {end}) of a "
                              f"parameter; its metadata is inconsistent")
