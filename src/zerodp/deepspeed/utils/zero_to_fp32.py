"""`deepspeed.utils.zero_to_fp32`: a whole fp32 state dict from a ZeRO checkpoint, and the checkpoint's files.

`get_fp32_state_dict_from_zero_checkpoint(dir, tag)` is zerodp's consolidation (any stage, any world size):
every `model.state_dict()` key, parameters as their fp32 masters. `get_optim_files` / `get_model_state_file`
return the DeepSpeed-named files `DeepSpeedEngine.save_checkpoint` writes beside zerodp's shards (see
zerodp/deepspeed/checkpoint_files.py): what PyTorch Lightning's `convert_zero_checkpoint_to_fp32_state_dict`
opens.
"""

from __future__ import annotations

from typing import Optional

from ...checkpoint import consolidate_checkpoint
from ...checkpoint import format as fmt
from ..checkpoint_files import find_model_state_file, find_optim_files

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "get_optim_files", "get_model_state_file"]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False, lazy_mode: bool = False) -> dict:
    """The whole model's state dict in fp32 on CPU from checkpoint `tag` (default: `latest`) in `checkpoint_dir`."""
    if lazy_mode:
        raise NotImplementedError("get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True) is not supported by "
                                  "zerodp; call it without lazy_mode (zerodp reads each tensor once, on CPU)")
    state = consolidate_checkpoint(checkpoint_dir, tag)
    if exclude_frozen_parameters:
        tensors = fmt.read_meta(fmt.resolve_tag_dir(checkpoint_dir, tag))["tensors"]
        state = {k: v for k, v in state.items() if tensors[k]["kind"] != "frozen"}
    return state


def get_optim_files(checkpoint_dir) -> list[str]:
    """The per-rank optimizer files of a checkpoint's tag directory, in rank order (index files here)."""
    return find_optim_files(checkpoint_dir)


def get_model_state_file(checkpoint_dir, zero_stage: int) -> str:
    """The file holding the client state of a checkpoint's tag directory, by DeepSpeed's name for `zero_stage`."""
    return find_model_state_file(checkpoint_dir, zero_stage)
