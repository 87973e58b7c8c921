"""The communication state of a process, as one object (`CommState`) that the engine's Runtime owns.

Everything `comm` remembers between calls lives here, not in module globals: the watchdog (its settings, flight
recorder and thread: watchdog.py), the world-size-1 decision (group.py), the collectives' `record()` logs and
observers (collectives.py), which default group zerodp created and how many (process_group.py), the hosts
learned per rank (topology.py), the communicators kept for reuse (local_groups.py) and the elastic attempt
agreed with the other ranks (elastic_attempt.py). The Runtime (zerodp/engine/runtime.py) makes one `CommState`
and installs it here when zerodp is imported; `comm`'s module functions read and write the installed one and
nothing else.

Settings come in two layers. The CommState's own (the watchdog's `settings`, `real_collectives`, the watchdog's
`activity`) are those outside every engine: the environment's, read when the CommState is made. `engine` is the
`EngineComm` in force over them: one engine's settings (its comm_timeout_s, debug_sync and rank, its world-size-1
decision) and its `Activity`, set by the Runtime to the newest live engine's between calls and by the engine to
its own around each of its calls (zero_engine.py `_under_lease`), then given back. So two engines stepped side by
side each run under their own settings, and when the last engine is closed `engine` is None and the settings
from before are in force again, with nothing to restore.

Why a pointer here and not an argument on every call: `comm` sits below the engine (it cannot import the
Runtime), and its functions are called from every tier with only a `group` in hand. One installed pointer is the
whole of comm's module state; a test installs a fresh `CommState` (through a fresh Runtime) and puts the old one
back, and nothing of one leaks into the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from .watchdog import Activity, Settings, Watchdog


@dataclass(eq=False)
class EngineComm:
    """One engine's settings for comm, in force while it runs a call (and, the newest engine's, between calls)."""

    watchdog: "Settings"      # its comm_timeout_s, debug_sync and rank
    real_collectives: bool    # its decision on collectives at world size 1 ([Note: collectives at world size 1])
    activity: "Activity"      # what it is doing, for the watchdog's reports


@dataclass(eq=False)
class CommState:
    """What `comm` remembers between calls (see the module docstring for which module uses which field). Made by
    the Runtime, `CommState(Watchdog())`: watchdog.py reads this module, so this one does not import it."""

    # watchdog.py: the settings outside every engine, the flight recorder, the waits and the thread
    watchdog: "Watchdog"
    # group.py: the decision on collectives at world size 1 outside every engine; None: the environment answers
    real_collectives: Optional[bool] = None
    # the engine whose settings are in force over the two above (see the module docstring); None: none
    engine: Optional[EngineComm] = None
    # collectives.py: the `record()` logs open now (a debugging aid, not configuration), the observers of every
    # collective (monitor/comms_logger.py) and whether their waits synchronize the device
    logs: list = field(default_factory=list)
    observers: list = field(default_factory=list)
    sync_device_on_wait: bool = False
    # process_group.py: the default group init_distributed created, while it lives (who owns it), and how many it
    # created in this process (names their store prefix: a re-made group must not read a dead one's keys)
    created_group: Any = None
    groups_created: int = 0
    # topology.py: global rank -> host under the live default group; warnings given; spans per group
    hosts: Any = None
    warned: set = field(default_factory=set)
    spans: dict = field(default_factory=dict)
    # local_groups.py: the communicators given back, for the live default group
    local_pool: Any = None
    # elastic_attempt.py: this process's attempt of an elastic job, once agreed (a process is in one attempt)
    elastic_attempt: Any = None


# The one module-level name of comm's state: the installed CommState (the Runtime's; see the module docstring).
# Written by install() only. The collectives' hot path reads it as `process_state.installed or
# process_state.current()`: an attribute read per collective, and current() only to raise where none is installed.
installed: Optional[CommState] = None


def install(state: Optional[CommState]) -> Optional[CommState]:
    """Make `state` the one `comm` uses (the Runtime's call, and tests'); returns the one it replaces."""
    global installed
    previous, installed = installed, state
    return previous


def current() -> CommState:
    """The installed CommState; importing zerodp installs the Runtime's."""
    if installed is None:
        raise RuntimeError("zerodp.comm has no CommState installed: `import zerodp` installs the Runtime's "
                           "(zerodp/engine/runtime.py); a test that installed None must install one back")
    return installed
