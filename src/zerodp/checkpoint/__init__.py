"""Checkpoints: sharded save and load at any world size or stage, consolidation to one state dict.

    save_load.py     save_checkpoint, read_checkpoint (atomic commit, resharding on load; the engine applies its own state)
    format.py        the on-disk format: file names, meta.json, safetensors files, checksums
    state.py         what a checkpoint holds of an engine, and how a new layout finds its part of it
    units.py         one unit's part of a checkpoint, saved and loaded one unit at a time (streaming)
    consolidate.py   full fp32 state dicts from disk (no process group) or from a live engine
    dcp.py           torch distributed checkpoint (DCP) export and import in FSDP2's / torchtitan's keys
    dcp_boxes.py     a shard's flat ranges as DCP's N-d boxes, and the planners that write and read them
    hf_export.py     streaming consolidation into the Hugging Face layout (sharded safetensors + index)
    param_values.py  one parameter's whole master, gradient or optimizer state from a live engine
    tensor_parallel.py  Checkpoints of ZeRO beside tensor parallelism: one zerodp checkpoint per tensor-parallel rank.
    tensor_reader.py    Reading a safetensors file by element ranges with plain reads: `TensorFileReader`.
    folder_kind.py   what a folder a load cannot read holds, and the way forward (one message)
  DeepSpeed's formats (docs/checkpoints.md):
    deepspeed_pickle.py      DeepSpeed's pickles read weights-only (its classes as inert records), and written
    deepspeed_reader.py      a DeepSpeed ZeRO or universal checkpoint shown to the loader as a zerodp one
    deepspeed_writer.py      DeepSpeed's ZeRO layout of an engine's state, beside zerodp's files
    deepspeed_zero_to_fp32.py  the standalone zero_to_fp32.py copied beside `latest` (torch only)
"""

from ..errors import CheckpointError
from .consolidate import (consolidate_checkpoint, consolidate_main, consolidate_tensor_parallel, full_state_dict,
                          save_consolidated)
from .dcp import read_dcp, save_dcp
from .param_values import GRAD, MASTER, whole_param_value
from .save_load import Resumed, read_checkpoint, save_checkpoint

__all__ = ["save_checkpoint", "read_checkpoint", "Resumed", "full_state_dict", "consolidate_checkpoint",
           "consolidate_tensor_parallel", "save_consolidated", "consolidate_main", "CheckpointError",
           "whole_param_value", "MASTER", "GRAD", "save_dcp", "read_dcp"]
