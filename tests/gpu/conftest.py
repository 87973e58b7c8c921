"""GPU tests run in the pytest process as a single NCCL rank, with ZERODP_REAL_COLLECTIVES=1 so that
every collective is really issued on the one-rank communicator (NCCL cannot put two ranks on one GPU;
without the switch zerodp skips collectives at world size 1, see [Note: collectives at world size 1]
in zerodp/comm/collectives.py). Skipped where CUDA is absent."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from zerodp import comm


@pytest.fixture(scope="session")
def nccl_group():
    """A one-rank NCCL default group on GPU 0 for the whole session, collectives really issued."""
    old = os.environ.get(comm.REAL_COLLECTIVES_ENV)
    os.environ[comm.REAL_COLLECTIVES_ENV] = "1"
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        torch.cuda.set_device(0)
        assert not comm.skips_collectives(), "the GPU tests must run real collectives"
        yield
        dist.destroy_process_group()
    if old is None:
        os.environ.pop(comm.REAL_COLLECTIVES_ENV, None)
    else:
        os.environ[comm.REAL_COLLECTIVES_ENV] = old
