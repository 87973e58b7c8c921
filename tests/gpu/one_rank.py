"""A one-rank default process group with every collective really issued, undone on exit: the fixture of
tests/gpu (NCCL on GPU 0), and the CPU suite's check of that undoing (gloo).

[Note: nothing after tests/gpu sees its group] On a GPU host `make test` runs tests/gpu in a pytest
process of its own (Makefile), and the fixture is package-scoped, so even in one process the NCCL group
and ZERODP_REAL_COLLECTIVES end with the last test of tests/gpu: a later test that builds a CPU model
never finds an NCCL default group (which would move its model to the GPU: zerodp/comm/module_device.py).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator

import torch
import torch.distributed as dist

from zerodp import comm


@contextlib.contextmanager
def one_rank_group(backend: str) -> Iterator[None]:
    """A one-rank default group of `backend` with ZERODP_REAL_COLLECTIVES=1; on exit the group is destroyed
    and the variable restored (also when the block raised)."""
    if dist.is_initialized():
        raise RuntimeError("one_rank_group: a default process group exists already (a test leaked one)")
    old = os.environ.get(comm.REAL_COLLECTIVES_ENV)
    os.environ[comm.REAL_COLLECTIVES_ENV] = "1"
    try:
        with tempfile.TemporaryDirectory() as d:
            if backend == "nccl":
                torch.cuda.set_device(0)
            dist.init_process_group(backend, init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
            try:
                assert not comm.skips_collectives(), "the GPU tests must run real collectives"
                yield
            finally:
                dist.destroy_process_group()
    finally:
        if old is None:
            os.environ.pop(comm.REAL_COLLECTIVES_ENV, None)
        else:
            os.environ[comm.REAL_COLLECTIVES_ENV] = old
