"""Where `zerodp train` puts a rank's tensors, how many ranks it starts, and the GPU memory it predicts.

Each decision is a function of device values and counts, so the CPU suite checks the CUDA answers with
`torch.device("cuda", 0)` and a GPU count given as data (no GPU needed):

  - `rank_device`: rank LOCAL_RANK's GPU when CUDA is available (NCCL needs CUDA tensors), else the CPU;
  - `sample_generator_device`: the device of the text sample's generator. `torch.multinomial` draws from
    a generator on the device of the probabilities ("Expected a 'cuda' device type for generator but
    found 'cpu'" otherwise), so it is the prompt's device. Every rank seeds its own generator alike and
    draws from the same probabilities, so all ranks sample the same text (stage 3 needs the same forwards);
  - `default_nproc`: one rank per GPU there is (each rank needs its own GPU), 2 CPU ranks without one;
  - `predicted_peak_cuda_bytes`: the peak `torch.cuda.max_memory_allocated()` of a rank, from the same
    formulas as the peak RSS (plan/peak_device.py), printed beside the measured peak.
"""

from __future__ import annotations

from typing import Optional

import torch

CPU_RANKS = 2  # without a GPU: two ranks, so the default run really shards (README's first command)


def rank_device(cuda_available: bool, local_rank: int) -> torch.device:
    """The device a rank computes on: its own GPU with CUDA, else the CPU."""
    return torch.device("cuda", local_rank) if cuda_available else torch.device("cpu")


def sample_generator_device(prompt_device: torch.device) -> torch.device:
    """The device of the sampling generator: the prompt's (the probabilities are computed there)."""
    return torch.device(prompt_device)


def sample_generator(prompt_device: torch.device, seed: int) -> torch.Generator:
    """A generator seeded with `seed` on `sample_generator_device(prompt_device)`."""
    return torch.Generator(device=sample_generator_device(prompt_device)).manual_seed(seed)


def default_nproc(gpu_count: int) -> int:
    """`--nproc` when not given: the GPUs there are, or CPU_RANKS without one."""
    return gpu_count if gpu_count > 0 else CPU_RANKS


def visible_gpus() -> int:
    """GPUs this process may use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def predicted_peak_cuda_bytes(model_name: str, config, world_size: int, seq_len: int) -> Optional[float]:
    """The predicted peak device memory of one rank of `zerodp train` (None where the config's optimizer is
    not one the formulas know)."""
    from ..plan.formulas import OPTIMIZER_STATES
    from ..plan.model_shape import gpt_shape, run_shape_of
    from ..plan.peak_device import predict_peak_device_bytes
    from ..models.gpt import MODEL_PRESETS

    optimizer = "adamw" if config.optimizer is None else str(getattr(config.optimizer, "type", "")).lower()
    if optimizer not in OPTIMIZER_STATES:
        return None
    micro = config.resolve_batch(world_size)[1]
    run = run_shape_of(config, world_size, optimizer, has_gpu=True)
    model = gpt_shape(MODEL_PRESETS[model_name], config, micro, seq_len, run.param_bytes)
    return predict_peak_device_bytes(model, run).total
