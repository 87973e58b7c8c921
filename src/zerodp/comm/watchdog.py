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
- `activity()` is what the engine running now is doing (each engine has its own `Activity`), updated at
  phase boundaries (a few attribute writes per step; no collective, no sync). The stage-3 hooks add the unit.
- `debug_sync` (config `zero_optimization.debug_sync` or `ZERODP_DEBUG_SYNC=1`) exchanges a small hash
  of each collective (op, tag, size, phase, unit) across its group before issuing it; on a mismatch
  every rank raises `DivergenceError` naming what each rank was about to do. It costs one extra
  collective per collective: a debugging aid, off by default.

The watchdog's state (its own settings, flight recorder, waits, thread) is one `Watchdog` object held by the
process's `CommState` (process_state.py), which the Runtime (zerodp/engine/runtime.py) owns; the functions below
act on the installed one. The settings (timeout, debug_sync, rank) and the `Activity` in force are the running
engine's (each engine's own while it runs a call: forward, backward, step, a checkpoint), the newest live
engine's between calls, and the watchdog's own (the environment's) with no engine. Each entry keeps the settings
in force when it was issued, so two engines with different comm_timeout_s each have their collectives watched
with their own.
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

from . import launch_env, process_state

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
    settings: Optional[Settings] = None  # those in force when it was issued (None: the watchdog's own, when read)

    @property
    def timeout_s(self) -> Optional[float]:
        return None if self.settings is None else self.settings.timeout_s

    def describe(self) -> str:
        target = f" of {self.what}" if self.what else ""
        return (f"#{self.seq} {self.op}{target} (tag {self.tag!r}, numel {self.numel}, {self.dtype}, "
                f"group {self.group}) [{self.state}] during {self.activity}")


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


class Watchdog:
    """The watchdog's state: its settings and activity outside every engine, the flight recorder, the waits and
    tracked collectives, and the thread that watches them. One per `CommState` (process_state.py)."""

    def __init__(self) -> None:
        self.settings = Settings.resolve()  # outside every engine: the environment's
        self.activity = Activity()  # outside every engine (zero.Init, a script calling zerodp.comm)
        self.recorder: collections.deque[Entry] = collections.deque(maxlen=RECORDER_SIZE)
        self.seq = 0
        self.waits: dict[int, tuple[float, Entry]] = {}  # thread id -> (since, entry)
        self.in_flight: list[tuple[float, Entry, Callable[[], bool]]] = []  # (since, entry, probe): see track()
        self.lock = threading.Lock()
        self.thread: Optional[threading.Thread] = None
        self.stop_event = threading.Event()  # set by stop(): the current thread's signal to end

    def issue(self, op: str, tag: str, numel: int, dtype, group_name: str, what: str, settings: Settings,
              activity: Activity) -> Entry:
        with self.lock:
            self.seq += 1
            entry = Entry(self.seq, op, tag, int(numel), str(dtype).removeprefix("torch."), group_name, what,
                          activity.describe(), settings=settings)
            self.recorder.append(entry)
        return entry

    def ensure_thread(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.stop_event = threading.Event()
            self.thread = threading.Thread(target=self._watch, args=(self.stop_event,), name="zerodp-watchdog",
                                           daemon=True)
            self.thread.start()

    def stop(self) -> None:
        thread, self.thread = self.thread, None
        with self.lock:
            self.in_flight.clear()
        if thread is not None:
            self.stop_event.set()
            if thread is not threading.current_thread():
                thread.join()

    def _poll_s(self) -> float:
        with self.lock:
            timeouts = [e.timeout_s for _, e in self.waits.values() if e.timeout_s is not None]
            timeouts += [e.timeout_s for _, e, _ in self.in_flight if e.timeout_s is not None]
        return min(1.0, max(0.05, min(timeouts + [self.settings.timeout_s]) / 10))

    def _watch(self, stop_event: threading.Event) -> None:
        while not stop_event.wait(self._poll_s()):
            now, timeout = time.monotonic(), self.settings.timeout_s
            with self.lock:
                waits, in_flight = list(self.waits.values()), list(self.in_flight)
            # note: the probes run outside the lock (a CUDA event query each); entries tracked meanwhile are kept
            found, pending = find_stalled(now, timeout, waits, in_flight)
            still = {id(item[1]) for item in pending}
            for _, entry, _ in in_flight:
                if id(entry) not in still:
                    entry.state = "done"
            with self.lock:
                self.in_flight[:] = pending + self.in_flight[len(in_flight):]
            if found is not None:
                since, entry = found
                issued = self.settings if entry.settings is None else entry.settings
                where = "in collective" if entry.state == "waiting" else "for the device to complete collective"
                sys.stderr.write(report(f"waited {now - since:.0f} s (comm_timeout_s={issued.timeout_s:g}) {where} "
                                        f"{entry.describe()}; exiting with code {EXIT_CODE}", issued.rank, self)
                                 + "\n")
                sys.stderr.flush()
                os._exit(EXIT_CODE)


def _dog() -> Watchdog:
    return (process_state.installed or process_state.current()).watchdog


def apply(settings: Settings) -> Settings:
    """Make `settings` the watchdog's own, in force outside every engine; returns the ones they replace."""
    dog = _dog()
    previous, dog.settings = dog.settings, settings
    return previous


def settings() -> Settings:
    """The settings in force: the running (else the newest live) engine's, or the watchdog's own."""
    state = process_state.installed or process_state.current()
    return state.watchdog.settings if state.engine is None else state.engine.watchdog


def timeout_s() -> float:
    return settings().timeout_s


def debug_sync_enabled() -> bool:
    return settings().debug_sync


def activity() -> Activity:
    """What the engine running now is doing (the newest live engine's between calls; the watchdog's own outside
    every engine): the stage-3 hooks set its unit."""
    state = process_state.installed or process_state.current()
    return state.watchdog.activity if state.engine is None else state.engine.activity


def issue(op: str, tag: str, numel: int, dtype, group_name: str, what: str = "") -> Entry:
    """Record a collective as issued, with the settings in force now; returns its flight-recorder entry."""
    state = process_state.installed or process_state.current()
    dog, engine = state.watchdog, state.engine
    if engine is None:
        return dog.issue(op, tag, numel, dtype, group_name, what, dog.settings, dog.activity)
    return dog.issue(op, tag, numel, dtype, group_name, what, engine.watchdog, engine.activity)


@contextlib.contextmanager
def waiting(entry: Optional[Entry]) -> Iterator[None]:
    """Mark a blocking wait on `entry`; the watchdog ends the process if it outlasts the entry's timeout."""
    if entry is None:
        yield
        return
    dog = _dog()
    dog.ensure_thread()
    key = threading.get_ident()
    entry.state = "waiting"
    with dog.lock:
        dog.waits[key] = (time.monotonic(), entry)
    try:
        yield
    finally:
        with dog.lock:
            dog.waits.pop(key, None)
        entry.state = "done"
        entry.done_at = time.monotonic()


def track(entry: Entry, probe: Callable[[], bool]) -> None:
    """Watch a collective whose wait returned before it was done: `probe()` turns true when it is
    ([Note: waits that do not block the host] in group.py)."""
    dog = _dog()
    dog.ensure_thread()
    entry.state = "in flight"  # the host's wait returned; the device has not said it is done
    with dog.lock:
        dog.in_flight.append((time.monotonic(), entry, probe))


def find_stalled(now: float, timeout_s: float, waits: list[tuple[float, Entry]],
                 in_flight: list[tuple[float, Entry, Callable[[], bool]]]):
    """(the first stalled (since, entry) or None, the in-flight collectives still not done). A wait is stalled
    when it has lasted its entry's timeout (`timeout_s` for an entry without one); a tracked collective when its
    probe is still false after that long."""
    def limit(entry: Entry) -> float:
        return timeout_s if entry.timeout_s is None else entry.timeout_s

    pending = [item for item in in_flight if not item[2]()]
    stalled = [(since, e) for since, e in waits if now - since > limit(e)]
    stalled += [(since, e) for since, e, _ in pending if now - since > limit(e)]
    return (min(stalled, key=lambda item: item[0]) if stalled else None), pending


def recent() -> list[Entry]:
    """The flight recorder's entries, oldest first."""
    dog = _dog()
    with dog.lock:
        return list(dog.recorder)


def signature(entry: Entry) -> int:
    """A hash of what must agree across ranks for a collective to match: the operation, its size and its
    target. Not the phase or the running unit: a gradient reduction may legitimately be launched while
    different ranks run different units (see stage3/collectives.py [Note: two communicators])."""
    text = f"{entry.op}|{entry.tag}|{entry.numel}|{entry.dtype}|{entry.what}"
    return zlib.crc32(text.encode())


def report(reason: str, rank: int, dog: Optional[Watchdog] = None) -> str:
    """What this rank was doing and its last collectives (`dog`'s, by default the installed watchdog's), ending
    with how to read several ranks' reports."""
    dog = _dog() if dog is None else dog
    with dog.lock:
        entries = list(dog.recorder)
    lines = [f"zerodp rank {rank}: {reason}", f"  doing: {dog.activity.describe()}",
             f"  last {RECORDER_SIZE} collectives of this rank, oldest first:"]
    lines += [f"    {e.describe()}" for e in entries]
    lines.append("  The first collective whose description differs between ranks' reports is where they diverged; "
                 "a rank missing from the reports is the one that stalled or died. Every rank must run the same "
                 "modules in the same order. Raise comm_timeout_s (or ZERODP_COMM_TIMEOUT_S) for steps that are "
                 "legitimately slow.")
    return "\n".join(lines)


def stop() -> None:
    """End the watchdog thread and forget tracked collectives (the Runtime's last close); the next wait
    starts it again."""
    _dog().stop()
