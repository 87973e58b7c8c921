"""The monitor the engine calls: DeepSpeed's monitoring sections behind four calls.

    engine.forward   -> before_forward(global_step)   flops_profiler starts counting at profile_step
    engine.backward  -> on_backward(loss)              records the loss (a detached tensor: no sync)
    engine.step      -> after_step(global_step, ...)   at each optimizer step: write the events, fold
                                                       comms latencies, end the flops profile
    engine.close     -> close()                        logs the comms summary, closes the writers

Events (rank 0, at every optimizer step, as DeepSpeed's engine writes them regardless of
steps_per_print), with DeepSpeed's names, to every enabled writer (csv_monitor, tensorboard, wandb):
    Train/Samples/train_loss   rank 0's mean loss over the step's micro-batches (what backward got)
    Train/Samples/lr           the first param group's learning rate after the step
    Train/Samples/loss_scale   fp16 only (as DeepSpeed): the loss scale after the step
    Train/Samples/grad_norm    the global gradient norm before clipping (not after a skipped step)
all at step = samples seen after the step (optimizer steps x train_batch_size). (DeepSpeed writes
train_loss during the last backward, at the previous step's sample count; here one step's events
share one x value.)

With every section off, the engine still calls these; each returns after one attribute check.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from .comms_logger import CommsLogger
from .event import GRAD_NORM, LOSS_SCALE, LR, TRAIN_LOSS, Event, EventWriter
from .flops_profiler import FlopsProfiler

log = logging.getLogger("zerodp")


class Monitor:
    """Owns the enabled writers (rank 0), the comms logger (every rank) and the flops profiler (rank 0)."""

    def __init__(self, writers: list[EventWriter], comms: Optional[CommsLogger], flops: Optional[FlopsProfiler],
                 rank: int, train_batch_size: int, fp16: bool) -> None:
        self.writers = writers
        self.comms_logger = comms
        self.flops_profiler = flops
        self.rank = rank
        self.train_batch_size = train_batch_size
        self.fp16 = fp16
        self._loss_sum: Optional[torch.Tensor] = None
        self._loss_count = 0
        self.last_events: list[Event] = []

    @classmethod
    def from_config(cls, config, rank: int, world_size: int, train_batch_size: int) -> "Monitor":
        """Build what `config` enables; a writer whose package is missing is refused on every rank."""
        from .tensorboard import TensorBoardMonitor, check_tensorboard
        from .wandb import WandbMonitor, check_wandb

        if config.tensorboard.enabled:
            check_tensorboard()
        if config.wandb.enabled:
            check_wandb()
        writers: list[EventWriter] = []
        if rank == 0:
            if config.csv_monitor.enabled:
                from .csv_monitor import CSVMonitor

                writers.append(CSVMonitor(config.csv_monitor))
            if config.tensorboard.enabled:
                writers.append(TensorBoardMonitor(config.tensorboard))
            if config.wandb.enabled:
                writers.append(WandbMonitor(config.wandb))
        comms = CommsLogger(config.comms_logger, world_size, rank) if config.comms_logger.enabled else None
        flops = FlopsProfiler(config.flops_profiler, world_size) if config.flops_profiler.enabled and rank == 0 \
            else None
        return cls(writers, comms, flops, rank, train_batch_size, config.fp16.enabled)

    # -- the engine's calls ----------------------------------------------------------------------

    def before_forward(self, global_step: int) -> None:
        if self.flops_profiler is not None:
            self.flops_profiler.before_forward(global_step)

    def on_backward(self, loss: torch.Tensor) -> None:
        if self.flops_profiler is not None:
            self.flops_profiler.before_backward()
        if not self.writers:
            return
        value = loss.detach().float()  # kept as a tensor: read once per optimizer step, in after_step
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def after_step(self, global_step: int, lr: float, loss_scale: float, grad_norm: Optional[float]) -> None:
        """After optimizer step `global_step - 1` (skipped or not): write its events, fold comms latencies."""
        if self.comms_logger is not None:
            self.comms_logger.fold()
        if self.flops_profiler is not None:
            self.flops_profiler.after_step(global_step)
        if not self.writers:
            return
        samples = global_step * self.train_batch_size
        events = []
        if self._loss_sum is not None:
            # note: a sync point (reads the loss), only when a monitor writes events
            events.append(Event(TRAIN_LOSS, float(self._loss_sum.item()) / self._loss_count, samples))
        events.append(Event(LR, float(lr), samples))
        if self.fp16:
            events.append(Event(LOSS_SCALE, float(loss_scale), samples))
        if grad_norm is not None:
            events.append(Event(GRAD_NORM, float(grad_norm), samples))
        for writer in self.writers:
            writer.write_events(events)
        self.last_events = events
        self._loss_sum, self._loss_count = None, 0

    def comms_summary(self) -> str:
        """The comms_logger's table for this rank (logged on rank 0); empty when comms_logger is off."""
        if self.comms_logger is None:
            return ""
        text = self.comms_logger.summary_text()
        if self.rank == 0:
            log.info("%s", text)
        return text

    def close(self) -> None:
        if self.comms_logger is not None:
            self.comms_summary()  # the end-of-run summary, as DeepSpeed's log_summary
            self.comms_logger.close()
            self.comms_logger = None
        if self.flops_profiler is not None:
            self.flops_profiler.close()
        for writer in self.writers:
            writer.close()
        self.writers = []
