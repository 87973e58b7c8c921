"""`comms_logger`: count, bytes and latency of every collective zerodp issues, per operation and message size.

It observes comm/collectives.py (`comm.add_observer`): each collective is counted when issued, so its
counts and bytes equal what `comm.record()` logs for the same calls; its latency is from issue to the
return of the host wait on it (`watchdog.Entry.done_at`; on CUDA the wait also synchronizes the device
while the logger is on, as DeepSpeed's timed collectives do). An asynchronous collective that overlaps
computation (overlap_comm, stage-3 prefetch) therefore reports the time until it was needed, which
includes the overlap. Latencies are folded in at each optimizer step and when a summary is asked for.

The summary is DeepSpeed's `log_summary` table: per operation and message size, the count, total and
mean latency, algorithmic bandwidth (bytes / latency) and bus bandwidth (algbw x the fraction of the
data a ring moves per rank: 2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter).
Bytes are the full buffer (the reduce input, the gather output), as `CommRecord.nbytes`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
import torch

from .. import comm
from ..config.monitor import CommsLoggerConfig, canonical_op

log = logging.getLogger("zerodp")

def active() -> "CommsLogger | None":
    """The newest comms logger not yet closed, or None (for deepspeed.comm.log_summary): read from comm's
    observers, where each logger is from its construction to its close(), so no registry of its own is kept."""
    loggers = [observer for observer in comm.observers() if isinstance(observer, CommsLogger)]
    return loggers[-1] if loggers else None

@dataclass
class OpStats:
    """One row of the summary: collectives of one operation (and tag, under debug) and message size."""

    count: int = 0
    nbytes: int = 0
    timed: int = 0          # how many of them have completed and been timed
    latency_s: float = 0.0  # summed over the timed ones

    @property
    def mean_latency_s(self) -> float:
        return self.latency_s / self.timed if self.timed else 0.0


def bus_factor(op: str, world_size: int) -> float:
    """Fraction of the buffer a ring moves through each rank's link (nccl-tests' busbw convention)."""
    n = world_size
    if n <= 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}.get(op, 1.0)


class CommsLogger:
    """Observes every collective while enabled; `summary()` and `summary_text()` report what it saw."""

    def __init__(self, config: CommsLoggerConfig, world_size: int, rank: int) -> None:
        self.config = config
        self.world_size, self.rank = world_size, rank
        self.ops = None if config.prof_all else {canonical_op(o) for o in config.prof_ops}
        # (row key, message bytes) -> stats; row key is the operation, or "op [tag]" under debug
        self.stats: dict[tuple[str, int], OpStats] = {}
        self._pending: list[tuple[tuple[str, int], "comm.watchdog.Entry", str]] = []
        comm.add_observer(self, sync_device_on_wait=torch.cuda.is_available())

    # -- called by comm for every collective -------------------------------------------------------

    def issued(self, record: "comm.CommRecord", entry, skipped: bool) -> None:
        if self.ops is not None and record.op not in self.ops:
            return
        name = f"{record.op} [{record.tag}]" if self.config.debug and record.tag else record.op
        key = (name, record.nbytes)
        stats = self.stats.setdefault(key, OpStats())
        stats.count += 1
        stats.nbytes += record.nbytes
        self._pending.append((key, entry, record.impl))

    # -- called by the monitor -------------------------------------------------------------------

    def fold(self) -> None:
        """Add the latency of every collective completed since the last fold (verbose: log each)."""
        still = []
        for key, entry, impl in self._pending:
            if entry.done_at is None:
                still.append((key, entry, impl))
                continue
            latency = entry.done_at - entry.issued_at
            stats = self.stats[key]
            stats.timed += 1
            stats.latency_s += latency
            if self.config.verbose and self.rank == 0:
                log.info("zerodp comm: %s (%s) %s in %.3f ms during %s", key[0], impl, _size(key[1]),
                         latency * 1e3, entry.activity)
        self._pending = still

    def summary(self) -> dict[str, dict[int, OpStats]]:
        """{operation (or "op [tag]"): {message bytes: OpStats}}, latencies folded in up to now."""
        self.fold()
        out: dict[str, dict[int, OpStats]] = {}
        for (name, nbytes), stats in sorted(self.stats.items()):
            out.setdefault(name, {})[nbytes] = stats
        return out

    def summary_text(self) -> str:
        """DeepSpeed's log_summary table for this rank."""
        header = (f"{'Comm. Op':<28}{'Message Size':>14}{'Count':>8}{'Total Latency(ms)':>19}"
                  f"{'Avg Latency(ms)':>17}{'tput_avg (Gbps)':>17}{'busbw_avg (Gbps)':>18}")
        lines = [f"zerodp comms_logger, rank {self.rank} of {self.world_size}:", header]
        for name, rows in self.summary().items():
            lines.append(name)
            op = name.split(" ", 1)[0]
            for nbytes, s in rows.items():
                algbw = (nbytes * 8 / s.mean_latency_s / 1e9) if s.mean_latency_s > 0 else 0.0
                lines.append(f"{'':<28}{_size(nbytes):>14}{s.count:>8}{s.latency_s * 1e3:>19.3f}"
                             f"{s.mean_latency_s * 1e3:>17.3f}{algbw:>17.3f}"
                             f"{algbw * bus_factor(op, self.world_size):>18.3f}")
        return "\n".join(lines)

    def close(self) -> None:
        comm.remove_observer(self)


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"
