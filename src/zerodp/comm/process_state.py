"""The communication state of a process, as one object (`CommState`) that the engine's Runtime owns.

Everything `comm` remembers between calls lives here, not in module globals: the watchdog (its settings, flight
recorder and thread: watchdog.py), the world-size-1 decision (group.py), the collectives' `record()` logs and
observers (collectives.py), which default group zerodp created and how many (process_group.py), the hosts
learned per rank (topology.py), the communicators kept for reuse (local_groups.py) and the elastic attempt
agreed with the other ranks (elastic_attempt.py). The Runtime (zerodp/engine/runtime.py) makes one `CommState`,
installs it here when zerodp is imported, and puts each engine's settings into it while that engine runs; `comm`'s
module functions read and write `current()` and nothing else.

Why a pointer here and not an argument on every call: `comm` sits below the engine (it cannot import the
Runtime), and its functions are called from every tier with only a `group` in hand. One installed pointer is the
whole of comm's module state; a test installs a fresh `CommState` (through a fresh Runtime) and puts the old one
back, and nothing of one leaks into the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from .watchdog import Watchdog


@dataclass(eq=False)
class CommState:
    """What `comm` remembers between calls (see the module docstring for which module uses which field)."""

    # watchdog.py: the settings in force, the flight recorder, the waits and the thread (made in __post_init__)
    watchdog: "Watchdog" = None  # type: ignore[assignment]
    # group.py: the engines' decision on collectives at world size 1; None: no engine made one (the env answers)
    real_collectives: Optional[bool] = None
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

    def __post_init__(self) -> None:
        if self.watchdog is None:
            from .watchdog import Watchdog  # watchdog.py reads current() at call time: imported here, not above

            self.watchdog = Watchdog()


# The one module-level name of comm's state: the installed CommState (the Runtime's; see the module docstring).
_installed: Optional[CommState] = None


def install(state: Optional[CommState]) -> Optional[CommState]:
    """Make `state` the one `comm` uses (the Runtime's call, and tests'); returns the one it replaces."""
    global _installed
    previous, _installed = _installed, state
    return previous


def current() -> CommState:
    """The installed CommState; importing zerodp installs the Runtime's."""
    if _installed is None:
        raise RuntimeError("zerodp.comm has no CommState installed: `import zerodp` installs the Runtime's "
                           "(zerodp/engine/runtime.py); a test that installed None must install one back")
    return _installed
