"""No silent hang: a watchdog over every blocking collective wait, and a flight recorder.

A collective blocks until every rank of its group joins. When one rank stalls or takes another
path, the others wait inside the backend (gloo's default is 30 minutes) and print nothing. So:

- every host-blocking wait in `comm` runs inside `waiting(entry)`; a daemon thread wakes once a
  second and, when a wait has lasted `comm_timeout_s`, prints what this rank was doing (global step,
  micro-step, phase, stage-3 unit, the collective, its tag and size) and its last collectives (the
  flight recorder, a ring buffer like torch's NCCL Flight Recorder), then ends the process with
  exit code 3. It must be `os._exit`: the main thread is blocked in C++ and cannot take an exception.
- `activity` is what the engine is doing, updated at phase boundaries (a few attribute writes per
  step; no collective, no sync). The stage-3 hooks add the unit.
- `debug_sync` (config `zero_optimization.debug_sync` or `ZERODP_DEBUG_SYNC=1`) exchanges a small hash
  of each collective (op, tag, size, phase, unit) across its group before issuing it; on a mismatch
  every rank raises `DivergenceError` naming what each rank was about to do. It costs one extra
  collective per collective: a debugging aid, off by default.

The timeout and the recorder are per process (one engine's ranks share them): module state, like
`comm.record()`'s logs, not configuration of any one engine.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

DEFAULT_TIMEOUT_S = 600.0
EXIT_CODE = 3
RECORDER_SIZE = 32


@dataclass
class Activity:
    """What this rank is doing, for diagnostics only."""

    global_step: int = 0
    micro_step: int = 0
    phase: str = "setup"   # setup | forward | backward | reduce | optimizer step | after-step gather | checkpoint
    unit: str = ""         # the stage-3 module unit being gathered or run, if any

    def enter(self, phase: str) -> None:
        """A new phase of the step; the stage-3 hooks set the unit again as modules run."""
        self.phase, self.unit = phase, ""

    def describe(self) -> str:
        unit = f", unit '{self.unit}'" if self.unit else ""
        return f"global step {self.global_step}, micro-step {self.micro_step}, phase {self.phase}{unit}"


@dataclass
class Entry:
    """One collective in the flight recorder."""

    seq: int
    op: str
    tag: str
    numel: int
    dtype: str
    group: str
    what: str
    activity: str
    issued_at: float = field(default_factory=time.monotonic)
    state: str = "issued"   # issued | waiting | done
    done_at: Optional[float] = None  # time.monotonic() when the host wait returned (comms_logger's latency)

    def describe(self) -> str:
        target = f" of {self.what}" if self.what else ""
        return (f"#{self.seq} {self.op}{target} (tag {self.tag!r}, numel {self.numel}, {self.dtype}, "
                f"group {self.group}) [{self.state}] during {self.activity}")


activity = Activity()
_recorder: collections.deque[Entry] = collections.deque(maxlen=RECORDER_SIZE)
_seq = 0
_waits: dict[int, tuple[float, Entry]] = {}  # thread id -> (since, entry)
_lock = threading.Lock()
_timeout_s = float(os.environ.get("ZERODP_COMM_TIMEOUT_S", DEFAULT_TIMEOUT_S))
_debug_sync = os.environ.get("ZERODP_DEBUG_SYNC", "") not in ("", "0")
_thread: Optional[threading.Thread] = None
_stop = threading.Event()  # set by stop(): the current thread's signal to end
_rank = int(os.environ.get("RANK", "0"))


def configure(timeout_s: Optional[float] = None, debug_sync: Optional[bool] = None,
              rank: Optional[int] = None) -> None:
    """Set the timeout (the environment's ZERODP_COMM_TIMEOUT_S wins) and debug_sync (env ORs in)."""
    global _timeout_s, _debug_sync, _rank
    if rank is not None:
        _rank = rank
    if timeout_s is not None and "ZERODP_COMM_TIMEOUT_S" not in os.environ:
        _timeout_s = float(timeout_s)
    if debug_sync is not None:
        _debug_sync = debug_sync or os.environ.get("ZERODP_DEBUG_SYNC", "") not in ("", "0")


def timeout_s() -> float:
    return _timeout_s


def debug_sync_enabled() -> bool:
    return _debug_sync


def issue(op: str, tag: str, numel: int, dtype, group_name: str, what: str = "") -> Entry:
    """Record a collective as issued; returns its flight-recorder entry."""
    global _seq
    with _lock:
        _seq += 1
        entry = Entry(_seq, op, tag, int(numel), str(dtype).removeprefix("torch."), group_name, what,
                      activity.describe())
        _recorder.append(entry)
    return entry


@contextlib.contextmanager
def waiting(entry: Optional[Entry]) -> Iterator[None]:
    """Mark a blocking wait on `entry`; the watchdog ends the process if it outlasts the timeout."""
    if entry is None:
        yield
        return
    _ensure_thread()
    key = threading.get_ident()
    entry.state = "waiting"
    with _lock:
        _waits[key] = (time.monotonic(), entry)
    try:
        yield
    finally:
        with _lock:
            _waits.pop(key, None)
        entry.state = "done"
        entry.done_at = time.monotonic()


def recent() -> list[Entry]:
    """The flight recorder's entries, oldest first."""
    with _lock:
        return list(_recorder)


def signature(entry: Entry) -> int:
    """A hash of what must agree across ranks for a collective to match: the operation, its size and its
    target. Not the phase or the running unit: a gradient reduction may legitimately be launched while
    different ranks run different units (see stage3/collectives.py [Note: two communicators])."""
    text = f"{entry.op}|{entry.tag}|{entry.numel}|{entry.dtype}|{entry.what}"
    return zlib.crc32(text.encode())


def report(reason: str, rank: int) -> str:
    lines = [f"zerodp rank {rank}: {reason}", f"  doing: {activity.describe()}",
             f"  last {RECORDER_SIZE} collectives of this rank, oldest first:"]
    lines += [f"    {e.describe()}" for e in recent()]
    lines.append("  The first collective whose description differs between ranks' reports is where they diverged; "
                 "a rank missing from the reports is the one that stalled or died. Every rank must run the same "
                 "modules in the same order. Raise comm_timeout_s (or ZERODP_COMM_TIMEOUT_S) for steps that are "
                 "legitimately slow.")
    return "\n".join(lines)


def _ensure_thread() -> None:
    global _thread, _stop
    if _thread is None or not _thread.is_alive():
        _stop = threading.Event()
        _thread = threading.Thread(target=_watch, args=(_stop,), name="zerodp-watchdog", daemon=True)
        _thread.start()


def stop() -> None:
    """End the watchdog thread (engine.close); the next blocking wait starts it again."""
    global _thread
    thread, _thread = _thread, None
    if thread is not None:
        _stop.set()
        if thread is not threading.current_thread():
            thread.join()



def _watch(stop_event: threading.Event) -> None:
    while not stop_event.wait(min(1.0, max(0.05, _timeout_s / 10))):
        now = time.monotonic()
        with _lock:
            stalled = [(since, e) for since, e in _waits.values() if now - since > _timeout_s]
        if stalled:
            since, entry = stalled[0]
            sys.stderr.write(report(f"waited {now - since:.0f} s (comm_timeout_s={_timeout_s:g}) in collective "
                                    f"{entry.describe()}; exiting with code {EXIT_CODE}", _rank) + "\n")
            sys.stderr.flush()
            os._exit(EXIT_CODE)
