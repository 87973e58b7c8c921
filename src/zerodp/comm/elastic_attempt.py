"""The attempt of an elastic job this process runs in, agreed by every rank on every node.

torch's elastic agent (torchrun, `elastic_launch`) restarts workers in attempts. Two facts make a local view
of the attempt wrong on several nodes:

- `TORCHELASTIC_RESTART_COUNT` is the *local* agent's count. When a worker dies on node A, A's agent restarts
  its workers with the count 1, but node B's agent restarts its own (healthy, stopped) workers because a new
  rendezvous round is pending, and gives them the count 0 (torch/distributed/elastic/agent/server/api.py:
  `_restart_workers` on `num_nodes_waiting`, without touching `_remaining_restarts`).
- The store the workers share (`TORCHELASTIC_USE_AGENT_STORE=True`: a TCPStore that rank-0 agent serves for
  the whole job, at MASTER_ADDR:MASTER_PORT) keeps every attempt's keys. A process group made again under the
  same names reads the dead attempt's addresses: gloo fails with "connectFullMesh ... Connection refused".

So the workers agree among themselves, through that store, on two things (`ElasticAttempt`):

- `job_id`: the same in every attempt of this job and different in every other job. The first worker to ask
  sets it (`compare_set` on an absent key); the store lives as long as the job, so a later attempt reads it.
- `index`: a number no earlier attempt of this job used, the same on every rank of this attempt: global rank 0
  draws it (`add` on a counter), so it is 0 for the first attempt and n after n restarts. [Note: handing out
  the attempt] explains how every other rank learns it without reading an earlier attempt's value.

Every attempt (the first too) then keys its process group under `zerodp/<job>/attempt<index>/...`
(process_group.py), and `zerodp train` knows a restart of its own run (`index > 0`) and its own run folder
(run.json records the `job_id`), whatever each node's agent counted.

Outside torch's elastic agent, or with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (each attempt then has a fresh
store of its own, served by rank 0), there is no job-long store: `current()` returns None and the callers use
the local count.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from typing import NamedTuple, Optional

import torch.distributed as dist

from . import process_state

NAMESPACE = "zerodp/elastic"
POLL_S = 0.01  # rank 0's poll of the other ranks' hellos: a one-off at start


class ElasticAttempt(NamedTuple):
    """This process's attempt of an elastic job, as every rank agrees on it."""

    job_id: str
    index: int
    store: dist.Store  # the job's store (a client of rank-0 agent's TCPStore)

    def prefix(self, generation: int) -> str:
        """The store prefix of the `generation`-th default process group made in this attempt."""
        return f"zerodp/{self.job_id}/attempt{self.index}/group{generation}"


def under_agent_store() -> bool:
    """True when torch's elastic agent started this process and serves a store for the whole job."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def current(timeout: Optional[timedelta] = None) -> Optional[ElasticAttempt]:
    """The attempt every rank agrees on (computed once per process; collective over the job's ranks:
    every rank of the attempt calls it before making its first process group), or None outside an agent
    store. `timeout`: how long to wait for the other ranks (default: the process group's)."""
    state = process_state.current()  # agreed once, kept in the Runtime's CommState (process_state.py)
    if state.elastic_attempt is None and under_agent_store():
        if timeout is None:
            from . import watchdog

            timeout = timedelta(seconds=watchdog.timeout_s() + 60.0)
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=False, timeout=timeout)
        state.elastic_attempt = agree(store, rank, world_size, timeout)
    return state.elastic_attempt


def agree(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> ElasticAttempt:
    """Agree with the other ranks of this attempt on the job and the attempt's index (see the module doc)."""
    ns = f"{NAMESPACE}/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}"
    job_id = store.compare_set(f"{ns}/job", "", uuid.uuid4().hex[:12]).decode()
    if rank == 0:
        index = store.add(f"{ns}/attempts", 1) - 1
        _hand_out(store, ns, index, world_size, time.monotonic() + timeout.total_seconds())
    else:
        # [Note: handing out the attempt] Every key a rank could wait on may still hold an earlier attempt's
        # value, except one named after something only this process knows: a fresh nonce. Each rank posts
        # its nonce under its rank; rank 0 answers every nonce it sees under a key named after that nonce;
        # the rank then acknowledges under a key named after the answer (new too, since no earlier attempt
        # drew that index). Rank 0 may first see a dead attempt's nonce: its answer goes to a key nobody
        # waits on, and rank 0 keeps answering until every rank has acknowledged. The workers of earlier
        # attempts are all stopped before a new rendezvous round completes, so none writes meanwhile.
        nonce = uuid.uuid4().hex
        store.set(f"{ns}/hello/{rank}", nonce)
        index = int(store.get(f"{ns}/answer/{nonce}"))  # blocks until rank 0 answers (or the timeout)
        store.set(f"{ns}/attempt{index}/ack/{rank}", "1")
    return ElasticAttempt(job_id, index, store)


def _hand_out(store: dist.Store, ns: str, index: int, world_size: int, deadline: float) -> None:
    """Rank 0's half of [Note: handing out the attempt]: answer every rank's nonce until all acknowledged."""
    answered: set[str] = set()
    waiting = set(range(1, world_size))
    while waiting:
        for rank in sorted(waiting):
            hello = f"{ns}/hello/{rank}"
            if store.check([hello]):
                nonce = store.get(hello).decode()
                if nonce not in answered:
                    store.set(f"{ns}/answer/{nonce}", str(index))
                    answered.add(nonce)
            if store.check([f"{ns}/attempt{index}/ack/{rank}"]):
                waiting.discard(rank)
        if waiting:
            if time.monotonic() > deadline:
                raise TimeoutError(f"elastic attempt {index}: rank(s) {sorted(waiting)} never joined the store at "
                                   f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}")
            time.sleep(POLL_S)

