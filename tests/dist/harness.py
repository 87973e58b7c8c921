"""Multi-rank test harness: a pool of long-lived gloo workers that run one function per case.

Design
------
Spawning a rank costs seconds (a fresh interpreter importing torch); running a case costs
milliseconds. So a `WorkerPool` spawns `world_size` processes once ("spawn" context, never
fork: fork would copy pytest's threads and state), each of which joins a gloo default process
group through a `file://` rendezvous in a fresh temp directory and then serves cases until closed.
The default group stays up for the pool's lifetime: a case may create and destroy its own
subgroups but must leave `dist.group.WORLD` initialized (a case that destroys it fails, and the
pool is replaced).

Protocol: the parent holds one duplex pipe per rank. `run(fn, ...)` pickles `(fn, args, kwargs)`
once (fn by reference, so it must be a module-level function of an importable module; the repo
root is put on the workers' `sys.path`, so `tests.dist.test_x.fn` resolves), sends the bytes to
every rank, and waits on all pipes *and* all process sentinels with one
`multiprocessing.connection.wait`. Each rank answers `("ok", value)` or `("error", traceback)`.

Failure is prompt and total: the first error, a worker exit, or the deadline kills every worker
(SIGKILL; the healthy ranks are usually blocked in a collective waiting for the failed one, and
gloo's own timeout is 30 minutes) and marks the pool dead. `get_pool` then builds a fresh one.
Nothing is retried or drained, so no stale message can leak into the next case.

Resources: at most `MAX_LIVE_POOLS` pools are alive at once (the CI machine has 2 cores); asking
for a further world size closes the least recently used pool. Pools close at session end (the
fixture in conftest.py) and at interpreter exit (atexit).

Workers inherit the parent's stdout/stderr file descriptors, so their prints land in the output
pytest captures for the case that is running.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing import connection
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
# before any group exists, as zerodp.comm does ([Note: a default group kept alive by default arguments]): else the
# workers' default group outlives destroy_process_group at pool close and meets C++ static destructors at exit
import torch.distributed.nn.functional  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT_S = 120.0
STARTUP_TIMEOUT_S = 120.0
MAX_LIVE_POOLS = 2
# Gloo's own deadline for a collective. Only a backstop: the parent kills hung workers first.
_GLOO_TIMEOUT = datetime.timedelta(minutes=10)


class WorkerError(RuntimeError):
    """A rank raised, or a worker process died; the message names the rank and has its traceback."""


# ---------------------------------------------------------------------------------------------
# Worker side (runs in the spawned processes)
# ---------------------------------------------------------------------------------------------


def _to_cpu(value: Any) -> Any:
    """Detached, compact CPU copies of every tensor in a (nested) return value."""

    def copy(x: Any) -> Any:
        # copy=True also drops a view's base storage, so only the viewed elements are pickled.
        return x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x

    return torch.utils._pytree.tree_map(copy, value)


def _send(conn: connection.Connection, status: str, payload: Any) -> None:
    # Plain pickle, not the ForkingPickler that conn.send uses: torch registers reductions there
    # that move tensors into shared memory and pass file descriptors; bytes are simpler.
    conn.send_bytes(pickle.dumps((status, payload), protocol=pickle.HIGHEST_PROTOCOL))


def _worker_main(rank: int, world_size: int, init_method: str, conn: connection.Connection) -> None:
    """Entry point of one rank: join the default group, then serve cases until told to stop."""
    # Ctrl-C reaches the whole process group; the parent handles it by killing the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=_GLOO_TIMEOUT
        )
        # the pool is up once every rank has connected, so that no close can meet a rank still connecting
        # ([Note: a communicator is made when every member has connected] in zerodp/comm/communicator.py)
        dist.barrier()
    except BaseException:
        _send(conn, "error", traceback.format_exc())
        return
    _send(conn, "ok", None)

    while True:
        try:
            task = conn.recv_bytes()
        except EOFError:  # the parent is gone
            break
        if task == b"":  # orderly shutdown
            break
        try:
            fn, args, kwargs = pickle.loads(task)
            # Cases share the process: undo the global switches a case is most likely to flip.
            torch.set_default_dtype(torch.float32)
            torch.set_grad_enabled(True)
            value = _to_cpu(fn(*args, **kwargs))
            if not dist.is_initialized():
                raise RuntimeError(
                    "the case destroyed the default process group; the harness keeps it up for the "
                    "pool's lifetime (create and destroy subgroups instead)"
                )
            reply = pickle.dumps(("ok", value), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:
            reply = pickle.dumps(("error", traceback.format_exc()), protocol=pickle.HIGHEST_PROTOCOL)
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send_bytes(reply)

    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Parent side (the pytest process)
# ---------------------------------------------------------------------------------------------


def _fn_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class WorkerPool:
    """`world_size` spawned ranks sharing one gloo default group, reused across test cases."""

    def __init__(self, world_size: int, startup_timeout: float = STARTUP_TIMEOUT_S):
        """Spawn the ranks and wait until every one has joined the default process group."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.dead = False
        self._calls = 0
        self._rendezvous_dir = tempfile.mkdtemp(prefix=f"zerodp-ws{world_size}-")
        init_method = "file://" + os.path.join(self._rendezvous_dir, "rendezvous")
        ctx = multiprocessing.get_context("spawn")
        self._conns: list[connection.Connection] = []
        self._procs = []
        # The children read OMP_NUM_THREADS when they import torch, before any of our code runs,
        # so it has to be in the environment they inherit.
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_worker_main,
                    args=(rank, world_size, init_method, child_end),
                    name=f"zerodp-test-rank{rank}-of-{world_size}",
                    daemon=True,
                )
                proc.start()
                child_end.close()
                self._conns.append(parent_end)
                self._procs.append(proc)
            self._gather("startup (init_process_group)", startup_timeout)
        except BaseException:
            self.kill()
            raise
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved

    @property
    def alive(self) -> bool:
        """True while the pool can take another case."""
        return not self.dead and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list:
        """Run `fn(*args, **kwargs)` on every rank; return the per-rank results in rank order.

        `fn` must be a module-level function (pickled by reference). Tensors in the results come
        back as CPU copies. On a remote exception, a worker exit or the timeout, the whole pool is
        killed and `WorkerError` / `TimeoutError` is raised at once.
        """
        if not self.alive:
            raise RuntimeError(f"WorkerPool(world_size={self.world_size}) is dead; use get_pool()")
        task = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        self._calls += 1
        try:
            for conn in self._conns:
                conn.send_bytes(task)
            return self._gather(_fn_name(fn), timeout)
        except BaseException:
            # Any failure (including Ctrl-C) can leave ranks blocked in a collective.
            self.kill()
            raise

    def _gather(self, what: str, timeout: float) -> list:
        """One reply per rank, failing fast on the first error, worker exit or the deadline."""
        results: list[Any] = [None] * self.world_size
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ranks = sorted(pending.values())
                raise TimeoutError(
                    f"{what} did not finish within timeout={timeout}s on world size "
                    f"{self.world_size} (ranks still running: {ranks}); the pool was killed"
                )
            ready = connection.wait([*pending, *sentinels], timeout=remaining)
            # Replies first: a rank that reported its exception and then died should be reported
            # by its traceback, not by its exit code.
            for conn in [r for r in ready if r in pending]:
                rank = pending.pop(conn)
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    raise self._died(rank, what) from None
                if status == "error":
                    # A rank whose peer died fails with "connection closed"; the dead peer is the news.
                    # Its exit may reach us a moment after this reply, so give it that moment.
                    dead = connection.wait(list(sentinels), timeout=2.0)
                    if dead:
                        raise self._died(sentinels[dead[0]], what)
                    raise WorkerError(
                        f"rank {rank} of {self.world_size} failed in {what}; remote traceback:\n"
                        f"{payload}{self._other_errors(pending)}"
                    )
                results[rank] = payload
            for sentinel in [r for r in ready if r in sentinels]:
                raise self._died(sentinels[sentinel], what)
        return results

    def _other_errors(self, pending: dict, timeout: float = 3.0) -> str:
        """The errors other ranks report within `timeout` of the first: the first to arrive is not always the
        cause (a rank whose peer raised and closed its sockets fails with "Connection closed by peer")."""
        others = []
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            ready = connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    continue
                if status == "error":
                    others.append(f"\n--- rank {rank} of {self.world_size} also failed:\n{payload}")
        return "".join(others)

    def _died(self, rank: int, what: str) -> WorkerError:
        proc = self._procs[rank]
        proc.join(timeout=1)
        return WorkerError(
            f"rank {rank} of {self.world_size}: worker process exited with code {proc.exitcode} "
            f"during {what}"
        )

    def close(self, timeout: float = 10.0) -> None:
        """Orderly shutdown: ask each rank to leave the group and exit; kill what does not."""
        if self.dead:
            return
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every worker at once (SIGKILL: healthy ranks may be stuck in a collective)."""
        self.dead = True
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._rendezvous_dir, ignore_errors=True)

    def __repr__(self) -> str:
        state = "alive" if self.alive else "dead"
        return f"WorkerPool(world_size={self.world_size}, {state}, calls={self._calls})"


# Test infrastructure, not library code: one cache per pytest process, bounded by MAX_LIVE_POOLS.
_pools: collections.OrderedDict[int, WorkerPool] = collections.OrderedDict()


def get_pool(world_size: int) -> WorkerPool:
    """A live pool for `world_size`, reused if cached; evicts the least recently used beyond the cap."""
    pool = _pools.get(world_size)
    if pool is not None and pool.alive:
        _pools.move_to_end(world_size)
        return pool
    if pool is not None:
        del _pools[world_size]
        pool.kill()
    while len(_pools) >= MAX_LIVE_POOLS:
        _, evicted = _pools.popitem(last=False)
        evicted.close()
    # start-up imports torch once per rank: more ranks than the 2 cores take proportionally longer
    pool = WorkerPool(world_size, startup_timeout=STARTUP_TIMEOUT_S * max(1, world_size // 2))
    _pools[world_size] = pool
    return pool


def run(world_size: int, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list:
    """`get_pool(world_size).run(fn, *args, timeout=timeout, **kwargs)`."""
    return get_pool(world_size).run(fn, *args, timeout=timeout, **kwargs)


def close_all_pools() -> None:
    """Shut down every cached pool (session end, interpreter exit)."""
    while _pools:
        _, pool = _pools.popitem()
        pool.close()


atexit.register(close_all_pools)
