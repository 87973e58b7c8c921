"""The progress line an engine logs on rank 0 every `steps_per_print` optimizer steps: `log_step`.

With `wall_clock_breakdown` it carries the seconds spent in forward, backward and step per step since the last
line (the engine's `timings`, which it then zeroes), and a line comes every 10 steps if `steps_per_print` is unset.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("zerodp")


def log_step(engine, since: float) -> float:
    """After an optimizer step of `engine`: log the line if this step is due one. `since` is when the interval began
    (perf_counter); returns when the next one begins (`since` itself when nothing was due)."""
    every = engine.config.steps_per_print or (10 if engine.config.wall_clock_breakdown else None)
    if not every or engine.global_step % every:
        return since
    now = time.perf_counter()
    if engine.rank == 0:
        breakdown = ""
        if engine.config.wall_clock_breakdown:
            breakdown = " " + " ".join(f"{k}={v / every:.3f}s" for k, v in engine.timings.items())
        log.info("zerodp step %d: loss_scale=%g grad_norm=%s skipped=%d (%.3fs/step)%s", engine.global_step,
                 engine.loss_scale, engine.grad_norm, engine.skipped_steps, (now - since) / every, breakdown)
    engine.timings = dict.fromkeys(engine.timings, 0.0)
    return now
