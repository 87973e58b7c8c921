"""The cheapest configuration whose predicted peak RSS fits a memory budget: `fit_memory`.

Candidates are tried in order of cost per step, and the first whose predicted peak (peak_rss.py)
fits the budget is the answer. The order, and why:

    1. stage 0        plain data parallel: an all-reduce of 2 Psi elements, nothing else
    2. stage 1        the same traffic, optimizer states sharded
    3. stage 2        the same traffic, gradients sharded too
    4. stage 3        parameters sharded too: 3 Psi elements of traffic (1.5x), gathers on the path
    5. stage 3 + offload_optimizer nvme
                      the optimizer state (Adam: 8 bytes per element of the shard) is read and
                      written once per step through the disk: slower than any network traffic
    6. stage 3 + both offloads nvme, max_in_cpu from half the shard down to a sixteenth, and unset
                      (the working set, buffer_count x the largest shard) where its size puts it:
                      the smaller the cache, the more parameter shards are read again in each
                      forward and backward

Stages 1-2 with offload are not candidates: their unsharded parameters (and stage 1's gradients)
stay in RAM, so whenever they fit, stage 3 without offload (4) fits as well and moves no bytes
through the disk. Pure arithmetic, as peak_rss.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .peak_rss import ModelShape, PeakRss, RunShape, predict_peak_rss


@dataclass(frozen=True)
class Candidate:
    """One configuration tried, its predicted peak, and whether it fits."""

    label: str
    run: RunShape
    peak: PeakRss
    fits: bool
    cost: str


@dataclass(frozen=True)
class FitResult:
    budget_bytes: float
    candidates: tuple[Candidate, ...]

    @property
    def chosen(self) -> Optional[Candidate]:
        return next((c for c in self.candidates if c.fits), None)


def _candidates(model: ModelShape, run: RunShape) -> list[tuple[str, RunShape, str]]:
    plain = dataclasses.replace(run, optimizer_offload="none", param_offload="none", max_in_cpu=None)
    out = [(f"stage {s}", dataclasses.replace(plain, stage=s), cost) for s, cost in (
        (0, "all-reduce of 2 Psi per step, nothing sharded"),
        (1, "same traffic as stage 0, optimizer states sharded"),
        (2, "same traffic as stage 0, gradients sharded too"),
        (3, "1.5x the traffic of stage 0: parameters gathered in forward and backward"))]
    opt = dataclasses.replace(plain, stage=3, optimizer_offload="nvme")
    out.append(("stage 3 + offload_optimizer nvme", opt, "stage 3's traffic, plus the optimizer state read and "
                "written through the disk every step"))
    shard = -(-model.numel // run.world_size)
    largest = -(-model.largest_unit_numel // run.world_size)
    working_set = run.param_buffer_count * largest  # what max_in_cpu unset caches (offload/tier.py)
    # Caches from half the shard down, the unset default among them by its size; none below one
    # largest shard (a gather holds that much resident whatever the bound).
    sizes = {shard // f: f"1/{f} of this rank's shard" for f in (2, 4, 8, 16) if shard // f >= largest}
    sizes[working_set] = "the gathers' working set"
    for size in sorted(sizes, reverse=True):
        unset = sizes[size] == "the gathers' working set"
        out.append((f"stage 3 + both offloads nvme, max_in_cpu " + ("unset" if unset else f"{size:,}"),
                    dataclasses.replace(opt, param_offload="nvme", max_in_cpu=None if unset else size),
                    f"as above, plus parameter (fp32: and gradient) shards read from the disk in forward and "
                    f"backward, {sizes[size]} cached"))
    return out


def fit_memory(model: ModelShape, run: RunShape, budget_bytes: float, baseline_bytes: float) -> FitResult:
    """Every candidate in cost order with its predicted peak; `chosen` is the first that fits."""
    if budget_bytes <= 0:
        raise ValueError(f"the memory budget must be positive, got {budget_bytes}")
    candidates = []
    for label, shape, cost in _candidates(model, run):
        peak = predict_peak_rss(model, shape, baseline_bytes)
        candidates.append(Candidate(label, shape, peak, peak.total <= budget_bytes, cost))
    return FitResult(budget_bytes, tuple(candidates))


def zero_section(run: RunShape) -> dict:
    """The `zero_optimization` keys that select `run`'s candidate (nvme_path is for the user to fill)."""
    section: dict = {"stage": run.stage}
    if run.optimizer_offload != "none":
        section["offload_optimizer"] = {"device": run.optimizer_offload, "nvme_path": "/path/on/a/fast/disk"}
    if run.param_offload != "none":
        section["offload_param"] = {"device": run.param_offload, "nvme_path": "/path/on/a/fast/disk"}
        if run.max_in_cpu is not None:
            section["offload_param"]["max_in_cpu"] = int(run.max_in_cpu)
    return section
