"""The process's checkpointing configuration: what `zerodp.activations.checkpoint` (and DeepSpeed's
module-level `deepspeed.checkpointing.checkpoint`) use.

DeepSpeed's checkpointing API is process-wide by design: `configure(mpu, ...)` once, then
`checkpoint(fn, *args)` anywhere in model code, with one RNG tracker. This module is the one place
that state lives, as a single `ProcessCheckpointing` object; the mechanism itself (Checkpointer) takes
its group and settings explicitly. `zerodp.initialize` adopts its config's `activation_checkpointing`
section (`adopt`) unless `configure` was called: an explicit configuration wins whichever comes first,
as in DeepSpeed, whose engine never reconfigures checkpointing (Megatron-DeepSpeed calls
`configure(mpu, deepspeed_config=..., num_checkpoints=...)` before `deepspeed.initialize`, and its
arguments must survive the engine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..config.activation_checkpointing import ActivationCheckpointingConfig
from .checkpointer import Checkpointer
from .model_parallel import ModelParallelGroup
from .rng_tracker import RNGStatesTracker

log = logging.getLogger("zerodp.activations")


@dataclass
class ProcessCheckpointing:
    """The installed Checkpointer (None until configured), the mpu it was given, and the one RNG tracker."""

    tracker: RNGStatesTracker = field(default_factory=RNGStatesTracker)
    checkpointer: Optional[Checkpointer] = None
    mpu: Optional[Any] = None
    from_engine: bool = False  # the installed configuration is an engine's section (not a configure call)

    def configure(self, settings: ActivationCheckpointingConfig, mpu: Optional[Any] = None) -> Checkpointer:
        """Install `settings` with the model-parallel group of `mpu` (or of the mpu given before)."""
        if mpu is not None:
            self.mpu = mpu
        group = ModelParallelGroup.from_mpu(self.mpu)
        self.checkpointer = Checkpointer(settings, group, self.tracker)
        self.from_engine = False
        return self.checkpointer

    def adopt(self, settings: ActivationCheckpointingConfig, mpu: Optional[Any] = None) -> Checkpointer:
        """An engine's section: installed unless `configure` was called, which then stays (see the module note)."""
        if self.checkpointer is not None and not self.from_engine:
            if self.checkpointer.settings != settings:
                log.info("activation_checkpointing: keeping the configuration deepspeed.checkpointing.configure "
                         "set (%s) over the engine config's section (%s)", self.checkpointer.settings, settings)
            return self.checkpointer
        checkpointer = self.configure(settings, mpu)
        self.from_engine = True
        return checkpointer

    def check(self, settings: ActivationCheckpointingConfig) -> None:
        """Raise what `adopt(settings)` would raise (e.g. partition_activations without an mpu), changing nothing."""
        if self.checkpointer is None or self.from_engine:
            Checkpointer(settings, ModelParallelGroup.from_mpu(self.mpu), self.tracker)

    def give_back(self) -> None:
        """Remove an engine's section (the last engine out: engine/runtime.py); a `configure` call's stays."""
        if self.from_engine:
            self.checkpointer, self.from_engine = None, False

    def current(self) -> Checkpointer:
        """The installed Checkpointer, or plain checkpointing (defaults) when none was configured."""
        if self.checkpointer is None:
            return Checkpointer(ActivationCheckpointingConfig(), ModelParallelGroup.from_mpu(self.mpu), self.tracker)
        return self.checkpointer

    def tp_rank(self) -> int:
        group = ModelParallelGroup.from_mpu(self.mpu)
        return 0 if group is None else group.rank


PROCESS = ProcessCheckpointing()


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` checkpointed (re-entrant) with the process's configuration."""
    return PROCESS.current().checkpoint(function, *args, **kwargs)


def non_reentrant_checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` checkpointed (non-re-entrant) with the process's configuration."""
    return PROCESS.current().non_reentrant_checkpoint(function, *args, **kwargs)
