"""GPU tests run in the pytest process as a single NCCL rank (one GPU is enough to exercise every
collective call and the device placement of zerodp's own tensors). Skipped where CUDA is absent."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def nccl_group():
    """A one-rank NCCL default group on GPU 0 for the whole session."""
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        torch.cuda.set_device(0)
        yield
        dist.destroy_process_group()
