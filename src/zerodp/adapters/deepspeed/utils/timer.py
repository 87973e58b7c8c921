"""`deepspeed.utils.timer.ThroughputTimer`: the engine's samples-per-second meter (`engine.tput_timer`).

The engine starts it at each forward and stops it at each step, counting a global step at every
accumulation boundary; scripts call `update_epoch_count()` at an epoch's end and read
`avg_samples_per_sec()`. As in DeepSpeed, the first `start_step` global steps (warm-up) are not timed,
and the figure is wall-clock time between forward and step, with no device synchronize on CPU.
"""

from __future__ import annotations

import time


class ThroughputTimer:
    """Counts epochs, micro and global steps, and the time spent in timed steps."""

    def __init__(self, batch_size: int, start_step: int = 2) -> None:
        self.batch_size = 1 if batch_size is None else batch_size  # samples per global step, all ranks
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self._started_at = None

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        # warm-up steps are not timed (compilation, first allocations), as DeepSpeed skips them
        self._started_at = time.perf_counter() if self.global_step_count >= self.start_step else 0.0

    def stop(self, global_step: bool = False) -> None:
        if self._started_at is None:  # step() without a forward since the last stop
            return
        started, self._started_at = self._started_at, None
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if started > 0.0:
            self.total_elapsed_time += time.perf_counter() - started

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed global steps; -inf before any (DeepSpeed's answer too)."""
        timed = self.global_step_count - self.start_step
        if timed <= 0 or self.total_elapsed_time <= 0.0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed)
