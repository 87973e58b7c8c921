"""GPU tests run in the pytest process as a single NCCL rank, with ZERODP_REAL_COLLECTIVES=1 so that
every collective is really issued on the one-rank communicator (NCCL cannot put two ranks on one GPU;
without the switch zerodp skips collectives at world size 1, see [Note: collectives at world size 1]
in zerodp/comm/collectives.py). Skipped where CUDA is absent.

The group lives for this package only, not the pytest session ([Note: nothing after tests/gpu sees its
group] in one_rank.py); `make test` also runs tests/gpu in a process of its own."""

import pytest

from tests.gpu.one_rank import one_rank_group


@pytest.fixture(scope="package")
def nccl_group():
    """A one-rank NCCL default group on GPU 0 for the tests of tests/gpu, collectives really issued."""
    with one_rank_group("nccl"):
        yield
