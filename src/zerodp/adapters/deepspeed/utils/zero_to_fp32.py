"""`deepspeed.utils.zero_to_fp32`: the whole fp32 model from a sharded checkpoint, offline (no process group).

    get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None)   the state dict (parameters in fp32, buffers)
    load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None)  loaded into `model` (on CPU), returned

    get_optim_files(tag_dir), get_model_state_file(tag_dir, zero_stage)    DeepSpeed-named files of a tag folder

`checkpoint_dir` is the folder `engine.save_checkpoint(save_dir)` wrote into (holding `latest` and the tag folders),
`tag` one of its checkpoints (default: the latest), as in DeepSpeed. The checkpoint is zerodp's format, from any
stage and world size (zerodp.consolidate_checkpoint reads it), or DeepSpeed's own (a ZeRO checkpoint of stages 1-3 or
a universal folder: zerodp/checkpoint/deepspeed_reader.py).
Tied weights are one tensor under every name, as DeepSpeed returns them. `get_optim_files` / `get_model_state_file`
return the DeepSpeed-named index files `DeepSpeedEngine.save_checkpoint` writes beside zerodp's shards
(zerodp/adapters/deepspeed/checkpoint_files.py): what PyTorch Lightning's `convert_zero_checkpoint_to_fp32_state_dict` opens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ....checkpoint import consolidate_checkpoint
from ....checkpoint.deepspeed_reader import deepspeed_state_dict, deepspeed_tag_dir
from ....checkpoint.format import read_meta, resolve_tag_dir
from ..checkpoint_files import find_model_state_file, find_optim_files

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint", "get_optim_files",
           "get_model_state_file"]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The model's state dict from checkpoint `tag` of `checkpoint_dir`, parameters in fp32, on CPU."""
    if lazy_mode:
        raise NotImplementedError("get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True) is not implemented in "
                                  "zerodp: the state dict is read whole; remove the argument")
    tag = None if tag is None else str(tag)
    ds_dir = deepspeed_tag_dir(Path(checkpoint_dir), tag)
    if ds_dir is not None:  # DeepSpeed's own files
        return deepspeed_state_dict(ds_dir, exclude_frozen_parameters)
    state = consolidate_checkpoint(checkpoint_dir, tag)
    if exclude_frozen_parameters:
        entries = read_meta(resolve_tag_dir(checkpoint_dir, tag))["tensors"]
        state = type(state)((k, v) for k, v in state.items() if entries[k]["kind"] != "frozen")
    return state


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag: Optional[str] = None):
    """Load the checkpoint's fp32 weights into `model` (moved to CPU first, as DeepSpeed does) and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def get_optim_files(checkpoint_dir) -> list[str]:
    """The per-rank optimizer files of a checkpoint's tag folder, in rank order (index files here)."""
    return find_optim_files(checkpoint_dir)


def get_model_state_file(checkpoint_dir, zero_stage: int) -> str:
    """The file holding the client state of a checkpoint's tag folder, by DeepSpeed's name for `zero_stage`."""
    return find_model_state_file(checkpoint_dir, zero_stage)
