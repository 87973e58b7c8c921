"""`deepspeed.comm`'s common calls, over torch.distributed (world size 1 without a process group)."""

from __future__ import annotations

import torch.distributed as dist

from .. import comm as _comm


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    return _comm.get_rank(group)


def get_world_size(group=None) -> int:
    return _comm.get_world_size(group)


def get_local_rank() -> int:
    import os

    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(group=None) -> None:
    if is_initialized():
        dist.barrier(group=group)


def init_distributed(*args, **kwargs) -> None:
    from . import init_distributed as _init

    _init(*args, **kwargs)


def log_summary(show_straggler: bool = False) -> str:
    """DeepSpeed's `deepspeed.comm.log_summary()`: the comms_logger table of this rank's collectives, logged on
    rank 0 and returned (the config's `comms_logger` section must be enabled)."""
    import logging

    from ..monitor import comms_logger

    if show_straggler:
        raise ValueError("log_summary(show_straggler=True) is not implemented in zerodp; call log_summary() for this "
                         "rank's table")
    logger = comms_logger.active()
    if logger is None:
        raise RuntimeError("log_summary(): no comms logger is running; set \"comms_logger\": {\"enabled\": true} "
                           "in the config (and call it before engine.close())")
    text = logger.summary_text()
    if logger.rank == 0:
        logging.getLogger("zerodp").info("%s", text)
    return text
