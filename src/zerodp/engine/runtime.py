"""The process-wide state zerodp changes, owned in one place: the `Runtime`, and each engine's `Lease` on it.

The Runtime owns comm's state: one `CommState` (comm/process_state.py) holding the watchdog, the collectives'
logs and observers, the world-size-1 decision, the default group's ownership, the learned hosts, the kept local
communicators and the elastic attempt. `comm` has no module state of its own: its functions act on the CommState
the Runtime installed (`RUNTIME.install()`, done below when zerodp is imported; a test installs a fresh
Runtime's and puts the old one back).

Five things belong to the process, not to any one engine:
- the real-collectives switch ([Note: collectives at world size 1] in comm/group.py): the user's
  ZERODP_REAL_COLLECTIVES=1 is read once, when an engine starts, and handed to the collectives as data;
- the watchdog's settings (timeout, debug_sync, rank), the activity its reports name, and its thread
  (comm/watchdog.py);
- the default process group: zerodp destroys it only if zerodp created it (comm/process_group.py) and
  only when no other engine is alive. Before the Runtime, each engine destroyed it at close(): with a
  second engine training beside the first, that one's next all-gather found no group (world size 1)
  and refused its buffers;
- glibc's allocator threshold, which offload sets for the whole process (host_memory.map_large_buffers);
- the activation checkpointing that `zerodp.activations.checkpoint` (and `deepspeed.checkpointing.checkpoint`)
  use, which an engine's `activation_checkpointing` section installs (activations/process_checkpointer.py): the
  newest live engine's section is in force, and the last engine out removes it (a `configure` call's stays).

Each engine takes a lease when it starts (`RUNTIME.lease(config, rank, process_group)`) and gives it back in
close(); an engine dropped without close() (garbage collected) counts as gone, silently. Each lease holds its
engine's `EngineComm` (comm/process_state.py: its watchdog settings, its world-size-1 decision, its activity), and
which one is in force over the process's own settings is `RUNTIME.comm.engine`: while an engine runs a call (its
forward, backward, step, checkpoint calls: zero_engine.py `_under_lease`, or `with lease.in_force():`), that
engine's; between calls, the newest live lease's; with no lease left, none, so the settings from before the first
lease are in force again with nothing to restore. So two engines with different comm_timeout_s each have their
own collectives watched with their own timeout. The last lease out also stops the watchdog thread, restores the
allocator and destroys a default group zerodp created. So engines can be built, stepped side by side and closed
in any order, and closing one changes nothing the others use.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from .. import activations, comm, host_memory
from ..comm import process_state, watchdog
from ..comm.process_state import CommState, EngineComm
from ..config.activation_checkpointing import ActivationCheckpointingConfig


@dataclass(frozen=True)
class RuntimeSettings:
    """What one engine asks of the process: decided once, when it starts."""

    watchdog: watchdog.Settings
    real_collectives: bool
    uses_default_group: bool   # the engine's collectives run on the default group (process_group=None)
    checkpointing: Optional[ActivationCheckpointingConfig] = None  # the config's section, where it has one

    @staticmethod
    def for_engine(config: Any, rank: int, process_group: comm.ProcessGroup,
                   checkpointing: bool = False) -> "RuntimeSettings":
        """Read from the engine's config and, once, from the environment (ZERODP_REAL_COLLECTIVES,
        ZERODP_COMM_TIMEOUT_S, ZERODP_DEBUG_SYNC). `checkpointing`: the config's `activation_checkpointing`
        section, where it has one, becomes the process's (what `zerodp.initialize` asks)."""
        given = checkpointing and "activation_checkpointing" in config.model_fields_set
        section = config.activation_checkpointing if given else None
        return RuntimeSettings(watchdog.Settings.resolve(config.comm_timeout_s, config.zero_optimization.debug_sync,
                                                         rank),
                               comm.real_collectives_requested(), process_group is None, section)


@dataclass(eq=False)
class Lease:
    """One engine's hold on the process-wide state; `close()` gives it back (idempotent)."""

    runtime: "Runtime"
    settings: RuntimeSettings
    closed: bool = False
    holder: Optional[Callable[[], Any]] = None  # a weak reference to the engine, once it exists
    comm: Optional[EngineComm] = None  # the engine's settings for comm, and its activity (made in __post_init__)

    def __post_init__(self) -> None:
        if self.comm is None:
            self.comm = EngineComm(self.settings.watchdog, self.settings.real_collectives, watchdog.Activity())

    @contextlib.contextmanager
    def in_force(self) -> Iterator[None]:
        """Run one engine call under this lease's settings and activity; the ones in force before come back
        after. (ZeroEngine's calls do the same two writes inline: zero_engine.py `_under_lease`.)"""
        state = self.runtime.comm
        outer, state.engine = state.engine, self.comm
        try:
            yield
        finally:
            state.engine = outer

    def held_by(self, engine: Any) -> None:
        """The engine this lease belongs to: once it is garbage collected, the lease no longer counts."""
        self.holder = weakref.ref(engine)

    @property
    def alive(self) -> bool:
        return not self.closed and (self.holder is None or self.holder() is not None)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.runtime.release(self)


@dataclass
class Runtime:
    """The process's zerodp state and the live leases on it (one instance: `RUNTIME`)."""

    leases: list[Lease] = field(default_factory=list)
    comm: CommState = field(default_factory=lambda: CommState(watchdog.Watchdog()))  # comm/process_state.py

    def install(self) -> Optional[CommState]:
        """Make this Runtime's CommState the one `comm` uses; returns the one it replaces."""
        return process_state.install(self.comm)

    def lease(self, config: Any, rank: int, process_group: comm.ProcessGroup = None,
              checkpointing: bool = False) -> Lease:
        """Put an engine's settings in force (see the module docstring) and return its lease. `checkpointing`:
        install the config's activation_checkpointing section (a section it cannot install raises here, and
        no lease is taken)."""
        settings = RuntimeSettings.for_engine(config, rank, process_group, checkpointing)
        if settings.checkpointing is not None:  # first: an invalid section leaves the process as it was
            activations.PROCESS.check(settings.checkpointing)
        self._forget_dropped()
        held = Lease(self, settings)
        self.leases.append(held)
        self.comm.engine = held.comm  # the newest engine's settings are in force (it is built under them)
        if settings.checkpointing is not None:  # DeepSpeed's section: the process's checkpointing
            activations.PROCESS.adopt(settings.checkpointing)
        return held

    def release(self, held: Lease) -> None:
        """Give `held` back: the newest remaining lease's settings come back; the last one out restores
        the process (see the module docstring)."""
        if held not in self.leases:
            return
        self.leases.remove(held)
        self._forget_dropped()
        self.comm.engine = self.leases[-1].comm if self.leases else None  # none left: the process's own settings
        if self.leases:
            sections = [held.settings.checkpointing for held in self.leases if held.settings.checkpointing is not None]
            if sections:
                activations.PROCESS.adopt(sections[-1])  # the newest live engine's section
            else:
                activations.PROCESS.give_back()  # only the departed engine had one
            return
        if held.settings.uses_default_group and comm.owns_default_group():
            comm.destroy_distributed()  # zerodp created it and no engine is left to use it
        self.comm.watchdog.stop()  # started again by the next wait, if any
        host_memory.restore_malloc_defaults()  # offload's mallopt: [Note: freed memory that stays resident]
        activations.PROCESS.give_back()  # the engines' checkpointing section; a configure() call's stays

    def _forget_dropped(self) -> None:
        # engines garbage collected without close(): a script that let its engine go, a test that did not close
        self.leases = [held for held in self.leases if held.alive]

    def backend_timeout_s(self, config: Any) -> float:
        """The process group's own timeout for an engine with `config`: it only backs the watchdog up,
        which reports first and says more."""
        return watchdog.Settings.resolve(config.comm_timeout_s).timeout_s + 60.0


RUNTIME = Runtime()  # the process's one Runtime: process-wide state by definition, owned here
RUNTIME.install()  # comm's functions act on RUNTIME.comm from now on
