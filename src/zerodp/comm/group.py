"""What zerodp asks of a process group: its rank, size and backend, whether its collectives are identities
(one rank) and whether a wait on it blocks the host. No collective is issued here.

[Note: collectives at world size 1] With one rank, collectives are skipped (identities), unless real
collectives are switched on and a process group exists: then they are issued on the one-rank
communicator like any other, so the real calls, streams and events run on one GPU (NCCL cannot put two
ranks on one device) or on one gloo rank. tests/gpu and a CPU test switch it on. The user's switch is
ZERODP_REAL_COLLECTIVES=1 in the environment, read once when an engine starts by the Runtime
(zerodp/engine/runtime.py), which keeps the decision in the engine's `EngineComm` (comm/process_state.py): in
force while that engine runs (and, the newest engine's, between calls), gone with the last engine.
The collectives ask `issues_no_collectives(group)`: while an engine lives, its decision, never the
environment; only outside every engine (a script calling zerodp.comm directly, zero.Init before
initialize) is the environment the answer. `skips_collectives(group)` is the caller's question "would
an engine built now skip them?", answered from the environment (a live engine keeps the decision it was
built with).

[Note: waits that do not block the host] On gloo (and MPI) `work.wait()` returns when the collective is
done, so a stalled peer blocks the waiting thread, where the watchdog sees it. On NCCL `work.wait()` only
orders the current CUDA stream after the collective and returns at once; the host blocks later, at
whatever reads a result (`.item()`, a copy to the CPU), outside any wait the watchdog knows. So after an
NCCL wait a CUDA event is recorded on the current stream and handed to the watchdog, which polls it
(`event.query()`, from its own thread) and names the collective when it has not completed within
comm_timeout_s. An event, not the work handle: NCCL's work keeps the collective's tensors alive, and
holding it until the next poll would hold a step's freed buffers too.
"""

from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist

from . import process_state

ProcessGroup = Optional[dist.ProcessGroup]

REAL_COLLECTIVES_ENV = "ZERODP_REAL_COLLECTIVES"  # the user's switch: [Note: collectives at world size 1]


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def real_collectives_requested() -> bool:
    """The user's switch, ZERODP_REAL_COLLECTIVES=1 in the environment (read by the Runtime once per engine)."""
    return os.environ.get(REAL_COLLECTIVES_ENV) == "1"


def issues_no_collectives(group: ProcessGroup = None) -> bool:
    """True where collectives on `group` are identities now: one rank, and real collectives not switched
    on (the live engines' decision, see [Note: collectives at world size 1])."""
    if get_world_size(group) != 1:
        return False
    state = process_state.installed or process_state.current()  # the engines' decision: process_state.py
    decided = state.real_collectives if state.engine is None else state.engine.real_collectives
    real = real_collectives_requested() if decided is None else decided
    return not (is_initialized() and real)


def skips_collectives(group: ProcessGroup = None) -> bool:
    """True where an engine built now would skip collectives on `group`: one rank, and the environment's
    switch off ([Note: collectives at world size 1])."""
    return get_world_size(group) == 1 and not (is_initialized() and real_collectives_requested())


def wait_blocks_host(backend: str) -> bool:
    """Whether `work.wait()` on `backend` returns only when the collective is done (gloo, mpi), or as soon as
    the current CUDA stream is ordered after it (NCCL): [Note: waits that do not block the host]."""
    return backend != "nccl"


def get_rank(group: ProcessGroup = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: ProcessGroup = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def backend_name(group: ProcessGroup = None) -> str:
    return str(dist.get_backend(group)) if is_initialized() else "none"
