"""Fixtures for multi-rank tests: `dist_run(world_size, fn, *args, **kwargs)` on pooled gloo ranks.

The worker pools live in `tests/dist/harness.py` and are shared by every test of the session; this
file only exposes them to pytest and closes them when the session ends.
"""

from __future__ import annotations

from typing import Callable

import pytest

from tests.dist import harness


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools():
    """Shut every worker pool down at session end (atexit is only the backstop)."""
    yield
    harness.close_all_pools()


@pytest.fixture
def dist_run() -> Callable[..., list]:
    """Callable `dist_run(world_size, fn, *args, timeout=120, **kwargs) -> list` of per-rank results.

    `fn` must be a module-level function of a test module; it runs on every rank of a pooled gloo
    group (the default group is already initialized) and must leave that group up.
    """
    return harness.run
