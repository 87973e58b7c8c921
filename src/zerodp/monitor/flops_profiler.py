"""`flops_profiler`: the FLOPs of one optimizer step, counted by torch.utils.flop_counter.FlopCounterMode.

On rank 0, from the first forward of optimizer step `profile_step` (0-based, as DeepSpeed's
global_steps) to the end of that step, every matmul, convolution and attention kernel is counted
(FlopCounterMode's formulas: 2mnk per matmul). The report's FLOPs are the model's: those counted
inside its modules' forward and backward (FlopCounterMode tracks modules); work the training script
does during the step outside the model (making a batch, a loss with a matmul) is reported apart.
Forward FLOPs are the model's between a forward's start and its backward; the rest is backward (and
activation recomputation, counted as it runs, which is why recompute_fwd_factor is not needed).
Achieved FLOP/s = FLOPs / the step's wall time (first forward to the end of the optimizer step, the
device synchronized at both ends).

For a stack of Linear layers on a batch of B rows: forward 2B*sum(in*out); backward twice that,
less the first layer's input gradient (2B*in0*out0) when the input needs none.
Every rank runs the same model on the same batch size, so the whole job's FLOPs are world_size x
rank 0's (the report says both).
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..config.monitor import FlopsProfilerConfig

log = logging.getLogger("zerodp")


class ProfilerState(enum.Enum):
    WAITING = "waiting"    # before the profiled step
    COUNTING = "counting"  # inside it: FlopCounterMode is entered
    DONE = "done"          # reported


@dataclass
class FlopsReport:
    """What the profiled step cost on this rank (`total_flops` = forward + backward)."""

    step: int
    micro_steps: int
    forward_flops: int
    total_flops: int
    outside_flops: int  # counted during the step outside the model's modules (the script's own work)
    step_time_s: float
    world_size: int
    module_flops: dict[str, int] = field(default_factory=dict)  # module path -> FLOPs (forward + backward)

    @property
    def backward_flops(self) -> int:
        return self.total_flops - self.forward_flops

    @property
    def flops_per_s(self) -> float:
        return self.total_flops / self.step_time_s if self.step_time_s > 0 else 0.0


class FlopsProfiler:
    """Counts one optimizer step's FLOPs on rank 0; `report` holds the result once the step ends."""

    def __init__(self, config: FlopsProfilerConfig, world_size: int) -> None:
        self.config = config
        self.world_size = world_size
        self.state = ProfilerState.WAITING
        self.report: Optional[FlopsReport] = None
        self._mode: Optional[FlopCounterMode] = None
        self._started_at = 0.0
        self._forward_started_at_flops = 0
        self._forward_flops = 0
        self._micro_steps = 0

    def before_forward(self, global_step: int) -> None:
        if self.state is ProfilerState.WAITING and global_step == self.config.profile_step:
            _synchronize()
            self._mode = FlopCounterMode(display=False)
            self._mode.__enter__()  # exited in after_step: the whole step runs under the mode
            self._started_at = time.perf_counter()
            self.state = ProfilerState.COUNTING
        if self.state is ProfilerState.COUNTING:
            self._forward_started_at_flops = self._model_flops()

    def before_backward(self) -> None:
        if self.state is ProfilerState.COUNTING:
            self._forward_flops += self._model_flops() - self._forward_started_at_flops
            self._micro_steps += 1

    def _model_flops(self) -> int:
        """FLOPs counted inside the model so far: its root module's (depth 0) count."""
        counts = self._mode.get_flop_counts()
        return sum(sum(per_op.values()) for name, per_op in counts.items() if name != "Global" and "." not in name)

    def after_step(self, global_step: int) -> Optional[FlopsReport]:
        """Called after optimizer step `global_step - 1` finished; returns the report when it was profiled."""
        if self.state is not ProfilerState.COUNTING:
            return None
        assert global_step == self.config.profile_step + 1, (global_step, self.config.profile_step)
        _synchronize()
        elapsed = time.perf_counter() - self._started_at
        self._mode.__exit__(None, None, None)
        counts = self._mode.get_flop_counts()
        modules = {name: sum(per_op.values()) for name, per_op in counts.items() if name != "Global"}
        model_flops = self._model_flops()
        self.report = FlopsReport(self.config.profile_step, self._micro_steps, self._forward_flops, model_flops,
                                  self._mode.get_total_flops() - model_flops, elapsed, self.world_size, modules)
        self._mode = None
        self.state = ProfilerState.DONE
        self._emit(render(self.report, self.config))
        return self.report

    def close(self) -> None:
        if self.state is ProfilerState.COUNTING:  # closed mid-step: leave the mode stack as it was
            self._mode.__exit__(None, None, None)
            self._mode = None
            self.state = ProfilerState.DONE

    # DeepSpeed's FlopsProfiler accessors
    def get_total_flops(self) -> int:
        return self.report.total_flops if self.report else 0

    def get_total_duration(self) -> float:
        return self.report.step_time_s if self.report else 0.0

    def _emit(self, text: str) -> None:
        if self.config.output_file:
            path = Path(self.config.output_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
            log.info("zerodp flops profiler: wrote %s", path)
        else:
            log.info("%s", text)


def render(report: FlopsReport, config: FlopsProfilerConfig) -> str:
    """The report as text: totals, achieved FLOP/s and (detailed) the top modules at each depth."""
    n = report.world_size
    lines = [f"zerodp flops profiler: optimizer step {report.step} ({report.micro_steps} micro-steps), rank 0 of {n}",
             f"  FLOPs per rank:  forward {_si(report.forward_flops)}, backward {_si(report.backward_flops)}, "
             f"total {_si(report.total_flops)} ({report.total_flops} FLOPs)",
             f"  FLOPs all ranks: {_si(report.total_flops * n)}",
             f"  outside the model (the script's own work during the step): {_si(report.outside_flops)}",
             f"  step time:       {report.step_time_s:.4f} s (first forward to the end of the optimizer step)",
             f"  achieved:        {_si(report.flops_per_s)}FLOP/s per rank, {_si(report.flops_per_s * n)}FLOP/s "
             f"all ranks"]
    if config.detailed and report.module_flops:
        lines.append("  top modules by FLOPs (forward + backward, per rank):")
        by_depth: dict[int, list[tuple[str, int]]] = {}
        for name, flops in report.module_flops.items():
            by_depth.setdefault(name.count("."), []).append((name, flops))
        for depth in sorted(by_depth):
            if config.module_depth != -1 and depth > config.module_depth:
                break
            top = sorted(by_depth[depth], key=lambda item: -item[1])[:config.top_modules]
            lines.append(f"    depth {depth}: " + ", ".join(f"{name} {_si(flops)}" for name, flops in top))
    return "\n".join(lines)


def _si(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3f} {unit}"
    return f"{value:.0f} "


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # note: a sync point, only at the profiled step's two ends
