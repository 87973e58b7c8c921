"""Checkpoints of ZeRO beside tensor parallelism: one zerodp checkpoint per tensor-parallel rank.

Each tensor-parallel rank's model is its own model (its shards of the sharded parameters, a copy of the
replicated ones), trained by ZeRO over its data-parallel group; so each writes an ordinary zerodp
checkpoint, of its data-parallel ranks' files, in a directory of its own:

    SAVE_DIR/tp-00-of-02/<tag>/...   tensor-parallel rank 0: shard-<dp rank>-of-<dp size>.safetensors,
                                     rng-<dp rank>.json, ...
    SAVE_DIR/tp-01-of-02/<tag>/...   tensor-parallel rank 1
    SAVE_DIR/tensor_parallel.json    the size and which parameters are sharded, how (written by world rank 0)

so every (tp, dp) rank writes its own files, each directory commits atomically ([Note: atomic commit] in
save_load.py), and a save returns on no rank before every tensor-parallel rank committed. A load reads
the directory of its tensor-parallel rank at any data-parallel size (resharding as usual); another
tensor-parallel size is refused, naming the saved one. `consolidate_tensor_parallel` merges the per-rank
state dicts (consolidate.py) into the unsharded model's by the recorded shard specs (tensor_parallel.layout),
and `zerodp consolidate SAVE_DIR OUT` writes that merged model.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from .. import comm
from ..errors import CheckpointError
from ..tensor_parallel.layout import ShardSpec, tensor_parallel_specs
from ..tensor_parallel.mpu import mpu_call

LAYOUT_FILE = "tensor_parallel.json"
_TP_DIR = re.compile(r"tp-(\d+)-of-(\d+)$")


def tp_dir(root, tp_rank: int, tp_size: int) -> Path:
    """Where tensor-parallel rank `tp_rank` of `tp_size` keeps its checkpoints under `root`."""
    return Path(root) / f"tp-{tp_rank:02d}-of-{tp_size:02d}"


def saved_tp_size(root) -> Optional[int]:
    """The tensor-parallel size the checkpoints under `root` were written with (None: no tp-* directories)."""
    sizes = {int(m.group(2)) for p in Path(root).iterdir() if (m := _TP_DIR.match(p.name))} \
        if Path(root).is_dir() else set()
    if len(sizes) > 1:
        raise CheckpointError(f"{root} holds checkpoints of several tensor-parallel sizes {sorted(sizes)}; "
                              f"keep one layout per directory")
    return sizes.pop() if sizes else None


def load_dir_for(root, tp_rank: int, tp_size: int) -> Path:
    """This tensor-parallel rank's directory under `root`, or a CheckpointError naming the mismatch."""
    saved = saved_tp_size(root)
    if saved is None:
        raise CheckpointError(f"{root} has no tensor-parallel checkpoint (tp-XX-of-YY directories); it was not "
                              f"saved by an engine with an mpu, or the path is wrong")
    if saved != tp_size:
        raise CheckpointError(f"{root} was saved at tensor-parallel size {saved}, this run has {tp_size}; "
                              f"resume with {saved} tensor-parallel ranks (data-parallel size may differ)")
    return tp_dir(root, tp_rank, tp_size)


def rank_dir(mpu: Any, root, saved: bool = False) -> Path:
    """This tensor-parallel rank's directory under `root` (`saved`: for loading, the saved layout checked first)."""
    rank, size = mpu_call(mpu, "get_model_parallel_rank"), mpu_call(mpu, "get_model_parallel_world_size")
    return load_dir_for(root, rank, size) if saved else tp_dir(root, rank, size)


def write_layout(root, tp_size: int, specs: Mapping[str, ShardSpec]) -> None:
    """Record the tensor-parallel layout beside the rank directories (one rank calls it), so consolidation
    needs no model: LAYOUT_FILE holds the size and each sharded parameter's [dim, stride]."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{LAYOUT_FILE}.tmp"
    tmp.write_text(json.dumps({"tensor_parallel_size": tp_size,
                               "specs": {name: [spec.dim, spec.stride] for name, spec in specs.items()}}, indent=1))
    os.replace(tmp, root / LAYOUT_FILE)


def read_layout(root) -> dict[str, ShardSpec]:
    """The specs `write_layout` recorded under `root`, or a CheckpointError naming what is missing."""
    path = Path(root) / LAYOUT_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the layout of the tensor-parallel parameters is unknown; pass "
                              f"specs=tensor_parallel_specs(model) to consolidate_tensor_parallel")
    return {name: ShardSpec(dim, stride) for name, (dim, stride) in json.loads(path.read_text())["specs"].items()}


def save_per_rank(mpu: Any, dp_rank: int, model, root, save: Callable[[Path], str]) -> str:
    """`save(directory)` into this tensor-parallel rank's directory under `root`, the layout of `model`'s
    sharded parameters beside them (world rank 0), and no rank returns before every one committed."""
    path = save(rank_dir(mpu, root))
    if dp_rank == 0 and mpu_call(mpu, "get_model_parallel_rank") == 0:
        write_layout(root, mpu_call(mpu, "get_model_parallel_world_size"), tensor_parallel_specs(model))
    wait_for_all(mpu_call(mpu, "get_model_parallel_group"))
    return path


def wait_for_all(model_parallel_group: comm.ProcessGroup) -> None:
    """Return on no tensor-parallel rank before all got here (after their directories' commits)."""
    comm.all_gather_object(True, model_parallel_group)  # note: a sync point across the tensor-parallel group
