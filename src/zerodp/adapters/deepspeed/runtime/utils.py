"""`deepspeed.runtime.utils`: the helpers scripts import (`see_memory_usage`, `set_random_seed`, `noop_context`)."""

from __future__ import annotations

import contextlib
import gc
import random

import torch
import torch.distributed as dist


def noop_context():
    """A context that does nothing (DeepSpeed's CPU streams are these)."""
    return contextlib.nullcontext()


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (DeepSpeed's helper does the same three)."""
    import numpy

    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log the accelerator's memory and the host's, on rank 0, when `force` is true (as DeepSpeed)."""
    if not force:
        return
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    import psutil

    from ..accelerator import get_accelerator
    from ..utils.logging import logger

    gc.collect()
    acc, gib = get_accelerator(), 2 ** 30
    logger.info(message)
    logger.info("MA %.2f GB  Max_MA %.2f GB  CA %.2f GB  Max_CA %.2f GB", acc.memory_allocated() / gib,
                acc.max_memory_allocated() / gib, acc.memory_reserved() / gib, acc.max_memory_reserved() / gib)
    vm = psutil.virtual_memory()
    logger.info("CPU Virtual Memory:  used = %.2f GB, percent = %s%%", (vm.total - vm.available) / gib, vm.percent)
    acc.reset_peak_memory_stats()
