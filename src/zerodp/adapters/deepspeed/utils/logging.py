"""`deepspeed.utils.logging`: the `logger` scripts import and `log_dist` (log on the listed ranks only)."""

from __future__ import annotations

import logging
from typing import Optional

import torch.distributed as dist


def _make_logger() -> logging.Logger:
    # DeepSpeed's logger prints INFO and above with the rank-agnostic format below, to stdout
    log = logging.getLogger("zerodp.deepspeed")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:"
                                               "%(funcName)s] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


logger = _make_logger()


def log_dist(message: str, ranks: Optional[list] = None, level: int = logging.INFO) -> None:
    """Log `message` on the ranks listed (-1: every rank); without a process group, always (DeepSpeed's rule)."""
    initialized = dist.is_available() and dist.is_initialized()
    my_rank = dist.get_rank() if initialized else -1
    ranks = ranks or []
    should_log = not initialized or (bool(ranks) and (ranks[0] == -1 or my_rank in set(ranks)))
    if should_log:
        logger.log(level, "[Rank %s] %s", my_rank, message)
