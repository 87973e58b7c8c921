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
