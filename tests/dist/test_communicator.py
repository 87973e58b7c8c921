"""A communicator is handed out only once every member has connected to it ([Note: a communicator is made when
every member has connected] in zerodp/comm/communicator.py).

Two ranks of their own, not the harness pool: the test needs a store of its own. Rank 1's store answers its
reads late, as a rank on a loaded machine polling a FileStore does, so rank 1 connects late. Without the wait,
rank 0 got the group back while rank 1 was still connecting whenever rank 0 was the pair's dialing side (gloo
picks it by port, about every second group), and destroying the group at once then failed rank 1 with
"Gloo connectFullMesh failed with ... Connection closed by peer" (the suite's intermittent failure). Both paths
that make communicators are checked: torch's counter-named groups that every rank makes (`new_group_like`),
destroyed at once, and those only the members make (`use_local_synchronization`), kept as zerodp keeps them
([Note: local communicators]: destroyed and made again, one would get the dead one's name).
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

from zerodp import comm
from zerodp.comm import communicator

ROUNDS = 4  # per path; without the wait each round catches rank 0 early with probability 1/2
READ_DELAY_S = 0.1  # rank 1's late store reads: far longer than rank 0 takes to dial and return


class _LateReads(dist.Store):
    """A store whose reads (get, wait) return `delay_s` late while `armed`; it notes when the last one returned."""

    def __init__(self, inner: dist.Store, delay_s: float) -> None:
        super().__init__()
        self.inner, self.delay_s, self.armed, self.last_read_s = inner, delay_s, False, 0.0

    def _late(self) -> None:
        if self.armed:
            time.sleep(self.delay_s)
            self.last_read_s = time.monotonic()

    def get(self, key):
        value = self.inner.get(key)
        self._late()
        return value

    def wait(self, keys, timeout=None):
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)
        self._late()

    def set(self, key, value):
        return self.inner.set(key, value)

    def add(self, key, value):
        return self.inner.add(key, value)

    def check(self, keys):
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def _make(path: str) -> dist.ProcessGroup:
    if path == "every rank":
        return comm.new_group_like(dist.group.WORLD)
    return communicator.new_group([0, 1], "gloo", local=True)


def _rank(rank: int, store_path: str, queue) -> None:
    """Make a communicator ROUNDS times per path, the counter-named ones destroyed at once (no collective on
    them); report per round when rank 0 got it back and when rank 1's last (late) store read returned."""
    try:
        store = _LateReads(dist.FileStore(store_path, 2), READ_DELAY_S if rank == 1 else 0.0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        rounds, kept = [], []
        for path in ("every rank", "members only") * ROUNDS:
            store.armed = True
            group = _make(path)
            returned_s = time.monotonic()
            store.armed = False
            if path == "every rank":
                comm.destroy_group(group)
                del group  # its sockets close now, as when an engine closes
            else:
                kept.append(group)  # destroyed with the default group
            rounds.append((path, returned_s, store.last_read_s))
        queue.put((rank, "ok", rounds))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))  # a SimpleQueue: written before put returns
        os._exit(1)  # the peer may be stuck in a collective; the parent kills it
    dist.destroy_process_group()


def test_a_communicator_is_returned_only_after_every_member_connected():
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "store"), queue), daemon=True)
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            replies, deadline = {}, time.monotonic() + 120
            while len(replies) < 2:
                assert time.monotonic() < deadline, f"no reply from rank(s) {sorted({0, 1} - set(replies))} in 120 s"
                if queue.empty():
                    time.sleep(0.05)
                    continue
                rank, status, payload = queue.get()
                assert status == "ok", f"rank {rank} failed:\n{payload}"
                replies[rank] = payload
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    for (path, rank0_returned_s, _), (_, _, rank1_last_read_s) in zip(replies[0], replies[1]):
        # the same clock in both processes (CLOCK_MONOTONIC is system-wide on Linux)
        assert rank1_last_read_s > 0.0
        assert rank0_returned_s >= rank1_last_read_s, (
            f"{path}: rank 0 got the communicator {rank1_last_read_s - rank0_returned_s:.3f} s before rank 1 had "
            f"read the addresses it connects to")
