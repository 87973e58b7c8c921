"""Each rank's peak RSS, predicted before launch: what a CPU rank holds at its fullest moment.

RSS is what the operating system counts (`ru_maxrss`, VmHWM), so the prediction is a sum of what is
resident at the peak, not just model states (`formulas.py`):

    peak = baseline                       python + torch + zerodp + gloo, measured once (baseline.py)
         + model states in RAM            by tier: what offload leaves in memory, not what is in files
         + offload I/O                    optimizer windows, cached parameter / gradient shards
         + working set at the peak        activations, gathered stage-3 units, gradient buffers
         + heap retention                 glibc's freed-but-resident holes ([Note: heap retention])

The working set is evaluated along one backward ([Note: where the peak sits]) and at the step, and
the larger moment is the peak. Everything here is arithmetic on sizes (`ModelShape`, `RunShape`): no
torch, no process group. Ranks are CPU processes: without a GPU, "device" memory is RSS too.

[Note: where the peak sits] In a forward the activations grow while units are gathered one at a
time, so the forward's fullest moment is its end, which is also where backward starts. Backward
then walks the units in reverse: the activations of the units not yet passed are still saved,
the current unit and the one prefetched behind it are gathered, the current unit's full gradient
buffer fills while at most two earlier ones are being reduced (`grads/reduce_queue.MAX_INFLIGHT`,
each with gloo's receive buffer of (N-1)/N of it), and with fp32 gradient shards offloaded the
gradient cache fills as reductions deliver. Activations fall while the gradient cache grows, so
the peak may be anywhere in between: every unit boundary is evaluated. The step holds the offload
cache and the optimizer's I/O windows (kept after the first step) but no activations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# Reductions in flight during backward (grads/reduce_queue.MAX_INFLIGHT; repeated here so the
# estimator needs no torch).
REDUCTIONS_IN_FLIGHT = 2

# [Note: heap retention] Without offload glibc's mmap threshold is dynamic: after the first large
# free it rises (up to 32 MiB), and every buffer below it comes from the heap, whose freed holes stay
# resident (host_memory.py). Two kinds of buffers leave holes, and RSS keeps them:
#   - building and stepping the model states allocates and frees unit-sized buffers (init slices,
#     gathered buffers, shards): on the 201M MLP without offload (2 ranks, fp32 AdamW, stage 3,
#     bench/offload_init_rss.py none) the peak minus everything else was 13-36% of the model states
#     in RAM (two runs, two ranks each): HEAP_RETENTION_STATES = 0.25, the middle;
#   - activations are freed in backward between other buffers; stage 3 trims the heap every 8 steps
#     (host_memory.py) but the holes of the steps in between add up. On `make train` (600 steps of the
#     small GPT, 67 MiB of activations per micro-batch) the peak minus everything else was 1.05x the
#     activations in one run (487-489 MiB), 1.5x in another (515-518 MiB, `make train`'s metrics.jsonl in bench/RESULTS.md, "make train RSS")
#     and 2.3x in the (570-571 MiB); 0.9x after 40 steps: HEAP_RETENTION_ACTIVATIONS = 1.6,
#     the middle of those runs.
# Both are fitted on those runs, not derived; the runs are named so that a change that moves them
# is noticed (bench/estimate_rss.py compares again). With any offload section on (cpu too), zerodp
# maps buffers of 1 MiB and more on their own (host_memory.py) and freed ones go back to the
# kernel: nothing is added.
HEAP_RETENTION_STATES = 0.25
HEAP_RETENTION_ACTIVATIONS = 1.6


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model that its memory depends on (no values).

    `unit_numels`: sharded elements of each stage-3 unit below the root, in forward order (their
    parameters below the persistence threshold excluded); `root_numel`: the root unit's (gathered
    for the whole forward and backward); `persistent_numel`: parameters that stay whole on every
    rank. `activation_bytes`: saved for backward by one micro-batch; `unit_activation_share`: the
    part of them saved inside the units (freed as backward passes each), the rest outside.
    """

    numel: int
    unit_numels: tuple[int, ...] = ()
    root_numel: int = 0
    persistent_numel: int = 0
    activation_bytes: float = 0.0
    unit_activation_share: float = 0.0
    largest_param_numel: int = 0

    @property
    def largest_unit_numel(self) -> int:
        return max(self.unit_numels, default=self.root_numel)


@dataclass(frozen=True)
class RunShape:
    """The settings of a run that its memory depends on (see `run_shape_of` for a config's)."""

    world_size: int
    stage: int
    param_bytes: int = 4           # per element of the compute parameters
    grad_bytes: int = 4
    master_bytes: int = 0          # fp32 master copy beside the parameters (mixed precision: 4)
    state_bytes: int = 8           # elementwise optimizer state per element (Adam: 2 fp32 words)
    optimizer_offload: str = "none"   # none | cpu | nvme (offload_optimizer.device)
    offload_ratio: float = 1.0
    sub_group_size: int = 4_000_000
    optimizer_buffer_count: int = 4
    param_offload: str = "none"       # none | cpu | nvme (offload_param.device)
    max_in_cpu: Optional[int] = None  # None: param_buffer_count x the largest shard (offload/tier.py)
    param_buffer_count: int = 5
    reduce_bucket_size: int = 5_000_000
    prefetch_numel: Optional[int] = None   # None: one unit ahead (stage3/partition.py)
    max_live_numel: int = 1_000_000_000
    has_gpu: bool = False

    @property
    def maps_large_buffers(self) -> bool:
        """Any offload section on (cpu included): the engine fixes glibc's mmap threshold (host_memory.py)."""
        return self.optimizer_offload != "none" or self.param_offload != "none"


@dataclass(frozen=True)
class RssTerm:
    """One part of the predicted peak: bytes, and the formula in words."""

    name: str
    bytes: float
    why: str


@dataclass(frozen=True)
class PeakRss:
    """The predicted peak RSS of one rank, as the sum of its terms, and where the peak sits."""

    terms: tuple[RssTerm, ...]
    moment: str
    disk_bytes: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.terms)

    def term(self, name: str) -> float:
        return sum(t.bytes for t in self.terms if t.name == name)


def _shard(numel: float, world_size: int) -> float:
    return -(-numel // world_size) if numel else 0


def _resident_states(model: ModelShape, run: RunShape) -> tuple[list[RssTerm], float, float]:
    """Model states in RAM by tier, the bytes in files, and the shard cache's bound in elements
    (max_in_cpu; unset: param_buffer_count x the largest shard, as offload/tier.py chooses)."""
    n, stage = run.world_size, run.stage
    sharded = model.numel - (model.persistent_numel if stage == 3 else 0)
    shard = _shard(sharded, n)
    largest_shard = _shard(model.largest_unit_numel, n)
    cache = run.max_in_cpu if run.max_in_cpu is not None else run.param_buffer_count * largest_shard
    terms, disk = [], 0.0
    if stage == 3:
        params = run.param_bytes * (shard + model.persistent_numel)
        why = f"{run.param_bytes} B x (Psi/N sharded + {model.persistent_numel:,} persistent elements)"
        if run.param_offload == "nvme":
            disk += run.param_bytes * shard
            params = run.param_bytes * (min(cache, shard) + model.persistent_numel)
            why = f"{run.param_bytes} B x min(max_in_cpu = {cache:,.0f}, shard) cached + persistent; the shard is in files"
    else:
        params, why = run.param_bytes * model.numel, f"{run.param_bytes} B x Psi (not sharded below stage 3)"
    terms.append(RssTerm("parameters", params, why))
    grad_numel = shard if stage >= 2 else model.numel
    grads, why = run.grad_bytes * grad_numel, f"{run.grad_bytes} B x " + ("Psi/N" if stage >= 2 else "Psi")
    if stage == 3 and run.param_offload == "nvme" and run.master_bytes == 0:
        # [Note: gradient shards offloaded] (offload/shard_store.py): fp32 gradient shards go with the parameters
        disk += run.grad_bytes * shard
        grads, why = 0.0, "in files with the parameters (fp32 with offload_param nvme); the cache is counted below"
    terms.append(RssTerm("gradients", grads, why))
    opt_numel = _shard(model.numel, n) if stage >= 1 else model.numel
    state = run.state_bytes * opt_numel
    optimizer, why = run.master_bytes * opt_numel + state, (f"({run.master_bytes} B master + {run.state_bytes} B "
                                                            f"state) x " + ("Psi/N" if stage >= 1 else "Psi"))
    if run.optimizer_offload == "nvme":
        disk += state * run.offload_ratio
        optimizer = run.master_bytes * opt_numel + state * (1 - run.offload_ratio)
        why = f"{run.master_bytes} B master x Psi/N; the state ({run.state_bytes} B/element) is in files"
    terms.append(RssTerm("optimizer states", optimizer, why))
    return terms, disk, cache


def _offload_io(model: ModelShape, run: RunShape) -> list[RssTerm]:
    """The offload tier's buffers in RAM once the first step has run (they are kept)."""
    terms = []
    if run.optimizer_offload == "nvme":
        opt_numel = _shard(model.numel, run.world_size) if run.stage >= 1 else model.numel
        window = min(run.sub_group_size or 1 << 18, opt_numel)
        # a slot is allocated when the pipeline first needs it (offload/optimizer_state.py): never more than
        # there are windows to read
        slots = min(run.optimizer_buffer_count, -(-opt_numel // window))
        terms.append(RssTerm("optimizer I/O windows", slots * window * run.state_bytes,
                             f"min(buffer_count {run.optimizer_buffer_count}, windows) x min(sub_group_size, "
                             f"shard) = {window:,.0f} elements x {run.state_bytes} B of state"))
    return terms


def _grad_cache_bytes(run: RunShape, cache: float, delivered_numel: float) -> float:
    """fp32 gradient shards offloaded with the parameters: cached up to max_in_cpu as they arrive."""
    if run.stage == 3 and run.param_offload == "nvme" and run.master_bytes == 0:
        return run.grad_bytes * min(cache, delivered_numel)
    return 0.0


def _backward_moments(model: ModelShape, run: RunShape, cache: float) -> list[tuple[str, list[RssTerm]]]:
    """The working set at each unit boundary of a backward ([Note: where the peak sits])."""
    n, units = run.world_size, list(model.unit_numels) or [0]
    receive = (n - 1) / n
    outside = model.activation_bytes * (1 - model.unit_activation_share)
    per_unit = model.activation_bytes * model.unit_activation_share / len(units)
    moments = []
    if run.stage == 3:
        for j in range(len(units) - 1, -1, -1):
            behind = units[j - 1] if j > 0 and run.prefetch_numel != 0 else 0
            gathered = min(model.root_numel + units[j] + behind, max(run.max_live_numel, model.root_numel + units[j]))
            inflight = units[j + 1:j + 1 + REDUCTIONS_IN_FLIGHT]
            grad_buffers = units[j] + model.root_numel + sum(inflight) * (1 + receive)
            delivered = sum(_shard(u, n) for u in units[j + 1 + REDUCTIONS_IN_FLIGHT:])
            moments.append((f"backward of unit {j + 1} of {len(units)}", [
                RssTerm("activations", outside + per_unit * (j + 1),
                        f"saved by one micro-batch, units 1..{j + 1} not yet passed"),
                RssTerm("gathered units", run.param_bytes * gathered,
                        "root + the unit in backward + the one prefetched behind it (full parameters)"),
                RssTerm("gradient buffers", run.grad_bytes * grad_buffers,
                        f"full gradients of that unit and the root, {len(inflight)} in reduction with "
                        f"(N-1)/N receive buffers"),
                RssTerm("gradient shard cache", _grad_cache_bytes(run, cache, delivered),
                        "fp32 gradient shards delivered so far, up to max_in_cpu")]))
        return moments
    bucket = min(run.reduce_bucket_size or model.numel, model.numel)
    buckets = -(-model.numel // bucket)
    if run.stage == 2:  # one bucket filling, the ones before it in reduction (at most two)
        inflight = min(REDUCTIONS_IN_FLIGHT, buckets - 1)
        buffers = bucket * (1 + inflight * (1 + receive))
        why = f"a bucket filling and {inflight} in reduction with (N-1)/N receive buffers"
    else:
        inflight = min(REDUCTIONS_IN_FLIGHT, buckets)
        buffers = bucket * inflight * receive
        why = f"receive buffers of {inflight} bucket reduction(s) in flight (the full gradients are model states)"
    moments.append(("start of backward", [
        RssTerm("activations", model.activation_bytes, "saved by one micro-batch"),
        RssTerm("gradient buffers", run.grad_bytes * buffers, f"{why}; buckets of {bucket:,} elements")]))
    return moments


def predict_peak_rss(model: ModelShape, run: RunShape, baseline_bytes: float) -> PeakRss:
    """The peak RSS of one rank of `run` training `model` (module docstring)."""
    if run.world_size < 1 or run.stage not in (0, 1, 2, 3):
        raise ValueError(f"world_size must be >= 1 and stage 0-3, got {run.world_size} and {run.stage}")
    states, disk, cache = _resident_states(model, run)
    io = _offload_io(model, run)
    moments = _backward_moments(model, run, cache)
    full_cache = _grad_cache_bytes(run, cache, _shard(model.numel, run.world_size))
    moments.append(("optimizer step", [RssTerm("gradient shard cache", full_cache, "every shard delivered, "
                                               "up to max_in_cpu")]))
    moment, working = max(moments, key=lambda m: sum(t.bytes for t in m[1]))
    terms = [RssTerm("baseline", baseline_bytes, "python + torch + zerodp + gloo on this machine (plan/baseline.py)")]
    terms += states + io + [t for t in working if t.bytes or t.name == "activations"]
    notes = []
    if not run.maps_large_buffers:  # [Note: heap retention]
        in_ram = sum(t.bytes for t in states)
        terms.append(RssTerm("heap retention", HEAP_RETENTION_STATES * in_ram + HEAP_RETENTION_ACTIVATIONS
                             * model.activation_bytes, f"{HEAP_RETENTION_STATES} x model states in RAM + "
                             f"{HEAP_RETENTION_ACTIVATIONS} x activations: glibc's freed holes (fitted)"))
    if run.has_gpu:
        notes.append("a GPU is present: this is the prediction for CPU ranks; device memory is not RSS")
    return PeakRss(tuple(t for t in terms if t.bytes or t.name in ("baseline", "activations")), moment, disk,
                   tuple(notes))
