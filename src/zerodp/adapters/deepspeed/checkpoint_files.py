"""DeepSpeed's file names in a zerodp checkpoint, for tools that open a DeepSpeed checkpoint's files.

zerodp's checkpoint (zerodp/checkpoint/format.py) keeps weights and optimizer state in per-rank
safetensors shards with a meta.json. Tools written for DeepSpeed's layout open two kinds of torch file
in the tag directory by DeepSpeed's names: PyTorch Lightning's `convert_zero_checkpoint_to_fp32_state_dict`
reads the ZeRO stage from `torch.load(get_optim_files(d)[0])["optimizer_state_dict"]["zero_stage"]` and the
client state (its trainer state) from `torch.load(get_model_state_file(d, stage))`. With
`checkpoint_format="zerodp"`, at stage 0, or with tensor parallelism, `DeepSpeedEngine.save_checkpoint` writes, on
rank 0 once the checkpoint is complete (otherwise it writes DeepSpeed's real layout under these names:
zerodp/checkpoint/deepspeed_writer.py),
  - `zero_pp_rank_<r>_mp_rank_00_optim_states.pt`, one per rank: {"optimizer_state_dict": {"zero_stage",
    "partition_count", "zerodp_shard": the rank's shard file}, "ds_version"}: an index, no tensors;
  - `mp_rank_00_model_states.pt` (stages 0-2) or `zero_pp_rank_0_mp_rank_00_model_states.pt` (stage 3),
    DeepSpeed's names for the file holding the client state: the client state with DeepSpeed's counters
    (global_steps, skipped_steps, dp_world_size, mp_world_size, ds_version) and no `module` (the weights
    are in the shards: `deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint` reads them).
zerodp never reads these files (they are outside meta.json's checksums), and resuming does not need them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...checkpoint import format as fmt
from _zerodp_deepspeed_alias import DEEPSPEED_VERSION

OPTIM_SUFFIX = "_optim_states.pt"


def optim_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00{OPTIM_SUFFIX}"


def model_state_file(zero_stage: int) -> str:
    return "zero_pp_rank_0_mp_rank_00_model_states.pt" if zero_stage >= 3 else "mp_rank_00_model_states.pt"


def write_deepspeed_files(tag_dir, zero_stage: int, world_size: int, global_steps: int, skipped_steps: int,
                          client_state: dict) -> None:
    """Write the index files above into a complete checkpoint's tag directory (rank 0 only)."""
    tag_dir = Path(tag_dir)
    for rank in range(world_size):
        torch.save({"optimizer_state_dict": {"zero_stage": zero_stage, "partition_count": world_size,
                                             "zerodp_shard": fmt.shard_file(rank, world_size)},
                    "ds_version": DEEPSPEED_VERSION}, tag_dir / optim_file(rank))
    states = {**client_state, "global_steps": global_steps, "skipped_steps": skipped_steps,
              "dp_world_size": world_size, "mp_world_size": 1, "ds_version": DEEPSPEED_VERSION}
    torch.save(states, tag_dir / model_state_file(zero_stage))


def find_optim_files(tag_dir) -> list[str]:
    tag_dir = Path(tag_dir)
    # "zero_pp_rank_<r>_..." or, for bf16 in DeepSpeed's layout, "bf16_zero_pp_rank_<r>_..."
    files = sorted(tag_dir.glob(f"*{OPTIM_SUFFIX}"), key=lambda p: int(p.name.split("zero_pp_rank_")[1].split("_")[0]))
    if not files:
        raise FileNotFoundError(f"no '*{OPTIM_SUFFIX}' files in {tag_dir}: pass a checkpoint's tag directory, "
                                f"written by zerodp.deepspeed's engine.save_checkpoint")
    return [str(p) for p in files]


def find_model_state_file(tag_dir, zero_stage: int) -> str:
    path = Path(tag_dir) / model_state_file(zero_stage)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass a checkpoint's tag directory, written by "
                                f"zerodp.deepspeed's engine.save_checkpoint, and its ZeRO stage")
    return str(path)
