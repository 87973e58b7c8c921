"""No silent hang: a watchdog over every blocking collective wait, and a flight recorder.

A collective blocks until every rank of its group joins. When one rank stalls or takes another
path, the others wait inside the backend (gloo's default is 30 minutes) and print nothing. So:

- every host-blocking wait in `comm` runs inside `waiting(entry)`; a daemon thread wakes once a
  second and, when a wait has lasted `comm_timeout_s`, prints what this rank was doing (global step,
  micro-step, phase, stage-3 unit, the collective, its tag and size) and its last collectives (the
  flight recorder, a ring buffer like torch's NCCL Flight Recorder), then ends the process with
  exit code 3. It must be `os._exit`: the main thread is blocked in C++ and cannot take an exception.
- a wait that does not block the host (NCCL) hands the watchdog a probe instead (`track(entry, probe)`,
  a CUDA event's `query`); the thread polls it and reports the same way when it is still false after
  `comm_timeout_s` ([Note: waits that do not block the host] in group.py). Which entry has stalled is
  decided by `find_stalled`, a pure function of the waits, the probes and the clock.
- `activity` is what the engine is doing, updated at phase boundaries (a few attribute writes per
  step; no collective, no sync). The stage-3 hooks add the unit.
- `debug_sync` (config `zero_optimization.debug_sync` or `ZERODP_DEBUG_SYNC=1`) exchanges a small hash
  of each collective (op, tag, size, phase, unit) across its group before issuing it; on a mismatch
  every rank raises `DivergenceError` naming what each rank was about to do. It costs one extra
  collective per collective: a debugging aid, off by default.

The recorder and the activity are per process: module state, like `comm.record()`'s logs. The settings
(timeout, debug_sync, rank) are process-wide too; the Runtime (zerodp/engine/zero_engine/runtime.py) sets them when an engine
starts (`apply`) and gives the previous ones back when it closes, so two engines do not reset each other's.
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
from typing import Callable, Iterator, NamedTuple, Optional

from . import launch_env

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
    state: str = "issued"   # issued | waiting | in flight (NCCL: on the device after the host's wait) | done
    done_at: Optional[float] = None  # time.monotonic() when the host wait returned (comms_logger's latency)

    def describe(self) -> str:
        target = f" of {self.what}" if self.what else ""
        return (f"#{self.seq} {self.op}{target} (tag {self.tag!r}, numel {self.numel}, {self.dtype}, "
                f"group {self.group}) [{self.state}] during {self.activity}")


activity = Activity()
_recorder: collections.deque[Entry] = collections.deque(maxlen=RECORDER_SIZE)
_seq = 0
_waits: dict[int, tuple[float, Entry]] = {}  # thread id -> (since, entry)
_in_flight: list[tuple[float, Entry, Callable[[], bool]]] = []  # (since, entry, probe): see track()
_lock = threading.Lock()
_thread: Optional[threading.Thread] = None
_stop = threading.Event()  # set by stop(): the current thread's signal to end


class Settings(NamedTuple):
    """The watchdog's process-wide settings."""

    timeout_s: float
    debug_sync: bool
    rank: int

    @staticmethod
    def resolve(timeout_s: Optional[float] = None, debug_sync: Optional[bool] = None,
                rank: Optional[int] = None) -> "Settings":
        """Settings from a config's values (None: the default), read with the environment once: its
        ZERODP_COMM_TIMEOUT_S wins over `timeout_s`, ZERODP_DEBUG_SYNC=1 ORs into `debug_sync`."""
        env_timeout = os.environ.get("ZERODP_COMM_TIMEOUT_S")
        if env_timeout is not None:
            timeout_s = float(env_timeout)
        env_sync = os.environ.get("ZERODP_DEBUG_SYNC", "") not in ("", "0")
        return Settings(DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s), bool(debug_sync) or env_sync,
                        launch_env.global_rank() if rank is None else rank)


_settings = Settings.resolve()


def apply(settings: Settings) -> Settings:
    """Make `settings` the process's (the Runtime's call); returns the ones they replace."""
    global _settings
    previous, _settings = _settings, settings
    return previous


def settings() -> Settings:
    return _settings


def timeout_s() -> float:
    return _settings.timeout_s


def debug_sync_enabled() -> bool:
    return _settings.debug_sync


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


def track(entry: Entry, probe: Callable[[], bool]) -> None:
    """Watch a collective whose wait returned before it was done: `probe()` turns true when it is
    ([Note: waits that do not block the host] in group.py)."""
    _ensure_thread()
    entry.state = "in flight"  # the host's wait returned; the device has not said it is done
    with _lock:
        _in_flight.append((time.monotonic(), entry, probe))


def find_stalled(now: float, timeout_s: float, waits: list[tuple[float, Entry]],
                 in_flight: list[tuple[float, Entry, Callable[[], bool]]]):
    """(the first stalled (since, entry) or None, the in-flight collectives still not done). A wait is stalled
    when it has lasted `timeout_s`; a tracked collective when its probe is still false after `timeout_s`."""
    pending = [item for item in in_flight if not item[2]()]
    stalled = [(since, e) for since, e in waits if now - since > timeout_s]
    stalled += [(since, e) for since, e, _ in pending if now - since > timeout_s]
    return (min(stalled, key=lambda item: item[0]) if stalled else None), pending


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
    """What this rank was doing and its last collectives, ending with how to read several ranks' reports."""
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
    """End the watchdog thread and forget tracked collectives (the Runtime's last close); the next wait
    starts it again."""
    global _thread
    thread, _thread = _thread, None
    with _lock:
        _in_flight.clear()
    if thread is not None:
        _stop.set()
        if thread is not threading.current_thread():
            thread.join()



def _watch(stop_event: threading.Event) -> None:
    while not stop_event.wait(min(1.0, max(0.05, _settings.timeout_s / 10))):
        now, timeout = time.monotonic(), _settings.timeout_s
        with _lock:
            waits, in_flight = list(_waits.values()), list(_in_flight)
        # note: the probes run outside the lock (a CUDA event query each); entries tracked meanwhile are kept
        found, pending = find_stalled(now, timeout, waits, in_flight)
        still = {id(item[1]) for item in pending}
        for _, entry, _ in in_flight:
            if id(entry) not in still:
                entry.state = "done"
        with _lock:
            _in_flight[:] = pending + _in_flight[len(in_flight):]
        if found is not None:
            since, entry = found
            where = "in collective" if entry.state == "waiting" else "for the device to complete collective"
            sys.stderr.write(report(f"waited {now - since:.0f} s (comm_timeout_s={timeout:g}) {where} "
                                    f"{entry.describe()}; exiting with code {EXIT_CODE}", _settings.rank) + "\n")
            sys.stderr.flush()
            os._exit(EXIT_CODE)
