"""`deepspeed.comm`'s common calls, over torch.distributed (world size 1 without a process group)."""

from __future__ import annotations

import torch.distributed as dist

from ... import comm as _comm


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    return _comm.get_rank(group)


def get_world_size(group=None) -> int:
    return _comm.get_world_size(group)


def get_local_rank() -> int:
    from ...comm.launch_env import local_rank

    return local_rank()


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

    from ...monitor import comms_logger

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


# --- the collectives, as torch.distributed's (DeepSpeed's own wrappers add logging keywords, dropped here) ---
ReduceOp = dist.ReduceOp
_DS_ONLY_KEYWORDS = ("prof", "log_name", "debug")


def _torch_collective(name: str):
    def collective(*args, **kwargs):
        for key in _DS_ONLY_KEYWORDS:  # DeepSpeed's comms-logger arguments: nothing to log them to here
            kwargs.pop(key, None)
        return getattr(dist, name)(*args, **kwargs)

    collective.__name__ = collective.__qualname__ = name
    collective.__doc__ = f"`deepspeed.comm.{name}`: torch.distributed.{name} (DeepSpeed's logging keywords ignored)."
    return collective


for _name in ("all_reduce", "broadcast", "all_gather", "gather", "scatter", "reduce", "reduce_scatter",
              "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "send", "recv",
              "isend", "irecv", "new_group", "get_global_rank", "destroy_process_group", "get_backend",
              "monitored_barrier", "all_gather_object", "broadcast_object_list", "init_process_group"):
    globals()[_name] = _torch_collective(_name)
del _name


def __getattr__(name: str):
    if name == "mori":  # `from deepspeed.comm import mori` (DeepSpeed's Qwen3 MoE example)
        raise ImportError("deepspeed.comm.mori (MoRI, the RDMA all-to-all DeepSpeed uses for expert parallelism) is not "
                          "provided by zerodp.deepspeed: zerodp is data parallel only, with no expert parallelism",
                          name="deepspeed.comm.mori")
    raise AttributeError(f"module 'zerodp.deepspeed.comm' has no attribute {name!r}")
