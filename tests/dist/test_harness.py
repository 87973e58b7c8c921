"""Self-test of the multi-rank harness: results, prompt failure on one rank, and timeouts.

Each test stands alone (`get_pool` spawns what is missing), but the order is chosen so that each
reuses the pools its predecessor left alive: spawning is what costs time here.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist import harness


def all_reduce_rank() -> dict:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t}


def raise_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure from the test")
    dist.barrier()  # rank 0 would wait here forever for rank 1


def raise_on_every_rank() -> None:
    raise ValueError(f"deliberate failure of rank {dist.get_rank()}")


def sleep_s(seconds: float) -> None:
    time.sleep(seconds)


def exit_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os._exit(7)
    dist.barrier()


def worker_env() -> tuple[str | None, int]:
    return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_returns_every_rank_result(dist_run, world_size):
    results = dist_run(world_size, all_reduce_rank)
    expected = world_size * (world_size + 1) / 2
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["world"] == world_size for r in results)
    for r in results:
        assert r["sum"].device.type == "cpu"
        torch.testing.assert_close(r["sum"], torch.tensor([expected]))


def test_workers_are_reused_and_single_threaded(dist_run):
    pool = harness.get_pool(2)
    assert dist_run(2, worker_env) == [("1", 1), ("1", 1)]
    assert harness.get_pool(2) is pool


def test_at_most_two_pools_live():
    three, two = harness.get_pool(3), harness.get_pool(2)
    one = harness.get_pool(1)  # a third world size evicts the least recently used pool (3)
    assert not three.alive
    assert two.alive and one.alive
    assert sum(p.alive for p in harness._pools.values()) <= harness.MAX_LIVE_POOLS


def test_error_on_one_rank_fails_fast_and_pool_recovers(dist_run):
    broken = harness.get_pool(2)
    start = time.monotonic()
    with pytest.raises(harness.WorkerError) as info:
        dist_run(2, raise_on_rank_1, timeout=60)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 1" in message
    assert "ValueError: deliberate failure from the test" in message
    assert "raise_on_rank_1" in message  # the remote traceback, not just the exception text
    # the blocked rank would hold the harness until timeout=60; 30 s leaves room for a loaded machine
    assert elapsed < 30, f"took {elapsed:.1f}s: the harness waited for the blocked rank"
    assert not broken.alive

    assert harness.get_pool(2) is not broken
    assert [r["sum"].item() for r in dist_run(2, all_reduce_rank)] == [3.0, 3.0]


def test_every_rank_that_failed_is_reported(dist_run):
    """The first error to arrive is not always the cause (a peer of the failed rank reports "Connection closed
    by peer"), so the others that arrive within moments come with it."""
    with pytest.raises(harness.WorkerError) as info:
        dist_run(2, raise_on_every_rank, timeout=60)
    message = str(info.value)
    assert "deliberate failure of rank 0" in message and "deliberate failure of rank 1" in message, message


def test_worker_exit_is_reported_with_exit_code(dist_run):
    with pytest.raises(harness.WorkerError, match=r"rank 1 of 2: worker process exited with code 7"):
        dist_run(2, exit_on_rank_1, timeout=60)


def test_timeout_raises_promptly(dist_run):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"sleep_s did not finish within timeout=1.0s"):
        dist_run(1, sleep_s, 60.0, timeout=1.0)
    assert time.monotonic() - start < 30  # far below the 60 s sleep, whatever else the machine runs
