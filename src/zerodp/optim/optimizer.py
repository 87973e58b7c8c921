"""The sharded optimizer: fp32 master shards, the inner optimizer, clipping, the step, parameter sync.

Each communication unit (a stage 0-2 `GradBucket` or a stage-3 unit) exposes this rank's slice of
its flat parameters (`param_shard`) and of its reduced, rank-averaged gradients (`grad_shard`). The
optimizer keeps one fp32 master tensor per unit shard and steps the user's optimizer, rebuilt over
those masters with the same per-group settings. With fp32 training the master *is* the parameter
shard (no copy: 4 bytes per element saved); with bf16/fp16 it is a separate fp32 copy.

[Note: optimizer chunks] The inner optimizer does not see one tensor per unit but consecutive views
of at most OPTIMIZER_CHUNK_NUMEL elements. The update is elementwise, so this is exact, and it is
much faster on CPU: torch's optimizers make several temporaries the size of each tensor, and a
temporary of a whole 100 MB shard is a fresh mmap that page-faults on every step and streams
through the caches once per operation, while a 1 MiB chunk stays in L2 (AdamW on 33.7M elements,
one thread: 0.19 s as one tensor, 0.094 s per parameter, 0.056 s in 1 MiB chunks). Everything
outside this class sees one flat master per unit: `state_of` / `load_state_of` present and accept
the optimizer state in those terms.

[Note: whole-tensor units] A unit laid out by `flat.whole_tensor_layout.WholeTensorLayout` (its
group's optimizer reads whole tensors: Muon, Adafactor) is not cut into chunks: the inner
optimizer sees one view per parameter this rank owns, shaped like the parameter, so the user's
optimizer runs on exactly what it would see in one process. A parameter that got no gradient keeps
`.grad = None` and torch skips it, as it would unsharded. Its state is per parameter (Adafactor's
row and column moments are neither elementwise nor scalar): `tensor_states_of` presents it so.

One step, in order (every rank runs the same collectives):
  1. fp16: any inf/nan in any rank's gradient shard skips the step on every rank (one flag all-reduce).
  2. unscale; global gradient norm = sqrt(sum over ranks of local squares): the unsharded model's norm.
  3. clip with torch's rule: coef = min(1, max_norm / (norm + 1e-6)), computed on the device; the
     gradients are multiplied by it (by 1.0 when not clipped: exact). A non-finite norm (bf16/fp32)
     returns NONFINITE before anything is written (see nonfinite.py): whether the norm is finite is
     the step's one host read of a device value in bf16/fp32 (issue 32; fp16's overflow vote is
     another), and the norm's value is read only when someone asks for `last_grad_norm`.
  4. step the inner optimizer; parameters that got no gradient anywhere are restored afterwards,
     as torch skips parameters whose .grad is None.
  5. copy masters into the parameter shards (the engine then has the strategy re-assemble full
     parameters: `seams.ShardingStrategy.after_step`).

Where things live comes from the engine's `placement.Placement`, decided once: the masters are the
parameter shards themselves (fp32 on one device), or copies in the master dtype on the placement's
device (the host, with offload_optimizer on a GPU: ZeRO-Offload steps there). Which windows a step
walks, what each holds resident (stage 3's offload_param, [Note: a unit owns its residency] in
stage3/flat_unit.py) and where each chunk's gradient comes from is the `StepPlan`'s (step_plan.py):
this class never asks what is offloaded.
"""

from __future__ import annotations

import bisect
import itertools
import math
from enum import Enum, auto
from typing import AbstractSet, Optional

import torch

from .. import comm
from ..shard.grads.grad_shard import square_norm
from ..offload.placement import Placement, placement_for_precision
from ..precision.policy import LossScaler, PrecisionPolicy
from ..shard.seams import ShardedUnit
from .inner import rebuild_kept
from .late_starters import LateStarters
from .chunk_pieces import ChunkPieces
from .step_counts import StepCounts
from .model_parallel import ModelParallelNorm
from .checkpoint_state import CheckpointStateAccess
from .shared_groups import share_param_groups
from ..optimizers.shard_norms import maybe_bind, segments_from_layout, split_segments
from .step_kernel import master_group_settings
from .grad_staging import GradStaging
from .step_path import BoundGradients, TransientGradients
from .step_plan import StepPlan, check_host_step
from .transient_grads import WindowedGradSteps, transient_grads_apply


# 1 MiB of fp32: fits L2 with room to spare, large enough that per-tensor overhead is negligible.
OPTIMIZER_CHUNK_NUMEL = 1 << 18


class StepOutcome(Enum):
    STEPPED = auto()
    OVERFLOW = auto()     # fp16: inf/nan under loss scaling; skipped, the scale is lowered
    NONFINITE = auto()    # bf16/fp32: the global gradient norm is NaN/Inf; nothing was written (nonfinite.py)


class ShardedOptimizer(CheckpointStateAccess):
    """Steps this rank's shards; see the module docstring for the order of one step."""

    def __init__(self, units: list[ShardedUnit], user_optimizer, group_settings: list[dict],
                 precision: PrecisionPolicy, scaler: LossScaler, process_group: comm.ProcessGroup,
                 sharded: bool, gradient_clipping: float, offload=None,
                 placement: Optional[Placement] = None, model_parallel: Optional[ModelParallelNorm] = None,
                 grad_staging: Optional[GradStaging] = None) -> None:
        self.units = units
        self.model_parallel = model_parallel  # tensor parallelism beside ZeRO: its norm rule (model_parallel.py)
        self.precision = precision
        self.scaler = scaler
        self.process_group = process_group
        self.sharded = sharded  # gradients/norms are split across ranks (stages 1-3)
        self.gradient_clipping = gradient_clipping
        self.offload = offload  # offload.OffloadedOptimizerState: where elementwise state lives, or None
        self.chunk_numel = offload.chunk_numel(OPTIMIZER_CHUNK_NUMEL) if offload else OPTIMIZER_CHUNK_NUMEL
        # no placement given (a caller of this class alone): everything where the first shard is
        self.placement = placement or placement_for_precision(
            precision, units[0].param_shard.device if units else torch.device("cpu"))
        check_host_step(group_settings, self.placement)
        masters_home = self.placement.masters
        self.masters: list[torch.Tensor] = []
        self.chunks: list[list[torch.Tensor]] = []
        self._chunk_starts: dict[int, tuple] = {}  # master index -> (its chunk list, the chunks' offsets): chunk_ranges
        for unit in units:
            with unit.resident():
                if self.placement.masters_are_shards:
                    self.masters.append(unit.param_shard)  # alias: updating the master updates the model
                else:  # a copy in the master dtype where the placement steps (the host under ZeRO-Offload)
                    self.masters.append(unit.param_shard.detach().to(masters_home.device, masters_home.dtype).clone())
                self.chunks.append(self._split(unit, self.masters[-1]))  # views: made while resident
        self.whole = [unit.layout.whole_tensors for unit in units]  # see [Note: whole-tensor units]
        # fused on CUDA masters, unchanged elsewhere (optim/step_kernel.py); a host step keeps torch's CPU kernels
        settings = master_group_settings(user_optimizer, group_settings, masters_home.device)
        groups = [dict(group, params=[]) for group in settings]
        for unit, chunks in zip(units, self.chunks):
            groups[unit.group_index]["params"].extend(chunks)
        # The user's group index of each inner group. Groups without trainable parameters are dropped;
        # a whole-tensor group is kept where this rank owns none of its tensors, so every rank has the
        # same groups (the same schedule, get_lr and checkpointed hyper-parameters).
        self.group_indices = sorted({unit.group_index for unit in units})
        self.optimizer = rebuild_kept(user_optimizer, groups, self.group_indices)
        # the user's group dicts are the inner groups (shared_groups.py): their changes reach the step
        self.shared_groups = share_param_groups(user_optimizer, self.optimizer, self.group_indices)
        # each parameter's own Adam step count ([Note: one step count per parameter] in step_counts.py); the
        # optimizers it does not cover are warned about ([Note: one step count per chunk] in late_starters.py)
        self.pieces = ChunkPieces(units, self.chunks, self.whole)  # each chunk's parameters, cut once (chunk_pieces.py)
        self.step_counts = StepCounts(units, self.whole, self.optimizer, self.group_indices, self.pieces)
        self.late_starters = LateStarters(units)
        if getattr(self.optimizer, "shard_norms", None) is not None:
            self._bind_shard_layout()
        if offload is not None:  # offload: the state moves to its store (see offload/optimizer_state.py)
            offload.attach(self.optimizer, self.chunks)
        # the windows, residency, gradient binding and write-back of every step (step_plan.py)
        # `grad_staging`: ZeRO-Offload's host copies of the gradient shards, their destination composed by the engine
        # (engine/grad_path.py); the plan reads them at the step
        self.plan = StepPlan(units, self.chunks, self.masters, self.placement, self.chunk_numel, offload,
                             grad_staging)
        # which gradients the step reads, chosen once (step_path.py): no step asks again
        self.path = (TransientGradients(WindowedGradSteps(self).run) if transient_grads_apply(self) else
                     BoundGradients(self.plan, self._step_chunks, self.plan.host_step and model_parallel is None))
        self._norm: Optional[torch.Tensor] = None       # the last step's global norm, on the device, unread
        self._norm_value: Optional[float] = None        # ... read once, when someone asks (last_grad_norm)
        self.last_step_skipped = False

    def _split(self, unit: ShardedUnit, master: torch.Tensor) -> list[torch.Tensor]:
        """The tensors the inner optimizer steps for one unit: chunks, or whole parameters."""
        if not unit.layout.whole_tensors:
            return list(master.split(self.chunk_numel))
        # the owned parameters are packed from the shard's start (whole_tensor_layout.py)
        return [master[s.shard_start:s.shard_start + s.numel].view(unit.layout.shapes[s.param_index])
                for s in unit.layout.segments(unit.shard_index)]

    def _bind_shard_layout(self) -> None:
        segments, slot = {}, 0
        for unit, chunks in zip(self.units, self.chunks):
            slots = list(range(slot, slot + len(unit.layout.shapes)))
            whole = segments_from_layout(slots, unit.layout.segments(unit.shard_index))
            for chunk, part in zip(chunks, split_segments(whole, [c.numel() for c in chunks])):
                segments[chunk] = part
            slot += len(slots)
        maybe_bind(self.optimizer, segments, slot, self.process_group, self.sharded)

    def chunk_ranges(self, index: int, lo: int, hi: int):
        """(chunk, chunk slice, master slice) for the chunks of master `index` overlapping [lo, hi). A binary search
        over the chunks' offsets: a 64-expert MoE's step asks this for thousands of parameter segments."""
        chunks = self.chunks[index]
        cached = self._chunk_starts.get(index)
        if cached is None or cached[0] is not chunks or len(cached[1]) != len(chunks) + 1:
            cached = (chunks, list(itertools.accumulate((c.numel() for c in chunks), initial=0)))
            self._chunk_starts[index] = cached
        starts = cached[1]
        k = bisect.bisect_right(starts, lo) - 1
        while k < len(chunks) and starts[k] < hi:
            a, b = max(lo, starts[k]), min(hi, starts[k + 1])
            if a < b:
                yield chunks[k], slice(a - starts[k], b - starts[k]), slice(a, b)
            k += 1

    def state_resident(self, index: int, read: bool = True, write: bool = True):
        """Hold master `index`'s optimizer state in `optimizer.state` for a block (`read`: its stored
        values are needed; `write`: the block changes them); the plan knows whether it is offloaded."""
        return self.plan.state_resident(self.chunks[index], read=read, write=write)

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (change `lr` here for a schedule)."""
        return self.optimizer.param_groups

    # -- the step ------------------------------------------------------------------------------

    def _overflow(self) -> bool:
        # one flag on the device for all units, read once with the vote (it was one read per unit before)
        bad = [torch.isfinite(u.grad_shard).all().logical_not() for u in self.units]
        local = torch.stack(bad).any() if bad else False
        # note: a sync point, the fp16 step's one read; every rank must agree before anyone steps
        overflow = comm.all_reduce_max_flag(local, self.process_group, tag="control")
        return overflow if self.model_parallel is None else self.model_parallel.any_overflow(overflow)

    def _global_norm(self, grads: list[torch.Tensor], casts: bool = False) -> torch.Tensor:
        """The unsharded model's gradient norm, a float64 tensor on the gradients' device (not read here).
        `casts`: each of `grads` is its shard, or the shard cast to the master dtype (no loss scale)."""
        if self.model_parallel is not None:  # sharded parameters summed over tensor-parallel ranks, others once
            sq = self.model_parallel.square_norms(self.units, grads)
            norm = math.sqrt(self.model_parallel.global_norm_squared(sq, self.process_group, self.sharded))
            return torch.full((), norm, dtype=torch.float64, device=sq.device)
        sq = torch.zeros(1, dtype=torch.float64, device=grads[0].device if grads else None)
        for unit, g in zip(self.units, grads):
            # the unit's own shard: its norm (an offloaded shard's is kept from its delivery, not read)
            # A cast's norm is its shard's: taken from the shard, as the transient and host steps do, so every path
            # (offloaded or not) clips by the same bits. On a CPU both are one computation; a GPU reduces a bf16
            # input in its own kernel, whose summation order need not be that of the fp32 copy's.
            sq += unit.grad_square_norm() if g is unit.grad_shard or casts else square_norm(g)
        if self.sharded:
            comm.all_reduce(sq, self.process_group, tag="norm")
        return sq.sqrt()[0]  # float64 sqrt: correctly rounded, as math.sqrt

    def _clip_coefficient(self, norm: torch.Tensor) -> Optional[torch.Tensor]:
        """torch's clip_grad_norm_ rule, min(1, max_norm / (norm + 1e-6)), computed on the norm's device: no host
        read. The same float64 operations as in Python floats, so the same value (a division, not `c / t`,
        which torch computes as a reciprocal times c: two roundings). None without clipping."""
        if self.gradient_clipping <= 0:
            return None
        coef = torch.full_like(norm, self.gradient_clipping).div_(norm + 1e-6).clamp_(max=1.0)
        # A non-finite norm leaves the gradients as they are (coefficient 1): the step is refused before it
        # writes (see `step`), and the diagnosis must read the gradients that were reduced, not NaNs of ours.
        return torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The last step's global gradient norm before clipping (None: the step was skipped for fp16 overflow).
        Read from the device on first use (note: a sync point the step itself does not take)."""
        if self._norm_value is None and self._norm is not None:
            self._norm_value = float(self._norm)
        return self._norm_value

    @property
    def last_grad_norm_tensor(self) -> Optional[torch.Tensor]:
        """`last_grad_norm` as a float64 tensor on the gradients' device, unread (None where it is None)."""
        return self._norm

    def step(self, received: Optional[torch.Tensor]) -> StepOutcome:
        """Run one optimizer step over the shards; returns whether it stepped or why it did not.

        `received` holds one flag per parameter (units concatenated): whether it got a gradient on
        any rank since the last step. None means every parameter did.
        """
        self.shared_groups.before_step()  # refuses a user optimizer whose groups were replaced since initialize
        check_overflow = self.scaler.scale != 1.0 or self.scaler.dynamic
        if check_overflow and self._overflow():
            self.scaler.update(overflow=True)
            self.last_step_skipped = True
            self._norm, self._norm_value = None, None
            self.plan.drop_grads()
            return StepOutcome.OVERFLOW
        raw = self.path.raw_grads(self.scaler.scale)  # the norm from the shards as reduced: no fp32 copies here
        grads = []
        for unit, master in zip(self.units, self.masters):
            same = raw or unit.grad_shard.dtype == master.dtype
            g = unit.grad_shard if same else unit.grad_shard.to(master.dtype)
            if self.scaler.scale != 1.0:
                g = g.div(self.scaler.scale) if g is unit.grad_shard else g.div_(self.scaler.scale)
            grads.append(g)
        norm = self._global_norm(grads, casts=self.scaler.scale == 1.0)
        self._norm, self._norm_value = norm, None
        coef = self._clip_coefficient(norm)
        self.path.bind(grads, coef, received, self.scaler.scale)  # (the transient path binds per window, in run)
        # note: a sync point, the step's one read in bf16/fp32 (issue 32): whether the norm is finite. A NaN/Inf
        # must not reach the masters (nonfinite.py) and torch's optimizers cannot skip on a device flag, so the
        # host must know before the first write; it asks as late as that, after the binding above, while the
        # device finishes the backward. The value itself stays on the device (`last_grad_norm` reads it).
        # fp16: the overflow vote passed, every gradient is finite: the norm's check needs no read of its own (a
        # float32 overflow of the norm would need elements near 1e19; the coefficient would then be 1, no NaN)
        if not check_overflow and not bool(torch.isfinite(norm)):
            # the same on every rank (the norm is global): see nonfinite.py
            self.plan.drop_grads()
            self.last_step_skipped = True
            return StepOutcome.NONFINITE
        late = self.step_counts.late(received)  # host lists: parameters stepped with their own count
        uncorrected = self.step_counts.late(received, corrected=False)  # ... and those warned of (late_starters.py)
        self.path.run(coef, received, late)
        self.plan.drop_grads()
        self.plan.write_back()  # the parameter shards follow their masters (unless they are them)
        self.step_counts.after_step(received)
        self.late_starters.after_step(uncorrected, self.optimizer)
        self.scaler.update(overflow=False)
        self.last_step_skipped = False
        return StepOutcome.STEPPED

    def _step_chunks(self, received: Optional[torch.Tensor], window: Optional[list],
                     late: AbstractSet[int] = frozenset()) -> None:
        """Step the inner optimizer over `window`'s chunks (None: all chunks); the `late` parameters (indices, units
        concatenated) are then stepped with their own counts (step_counts.py)."""
        only = None if window is None else {id(c) for c in window}
        hidden = []
        if only is not None:  # torch skips parameters without .grad: hide the chunks outside the window
            hidden = [c for chunks in self.chunks for c in chunks if id(c) not in only]
            grads = [c.grad for c in hidden]
            for c in hidden:
                c.grad = None
        self.step_inner(received, only, late)
        for c, g in zip(hidden, grads if hidden else []):
            c.grad = g

    def step_inner(self, received: Optional[torch.Tensor], only: Optional[set], late: AbstractSet[int]) -> None:
        """One step of the inner optimizer over the chunks with a .grad (`only`: their ids, None: all): the
        parameters without a gradient are left as torch leaves them, the `late` ones then stepped with their own
        counts (step_counts.py)."""
        sliced = self.step_counts.sliced_chunks(self, received, only)  # [Note: sliced chunks] in step_counts.py
        if sliced:  # stepped after, slice by slice: hidden from the chunk step (torch skips a tensor without .grad)
            hidden = [(chunk, chunk.grad) for _, chunk, _ in sliced.values()]
            for chunk, _ in hidden:
                chunk.grad = None
            rest = {id(c) for chunks in self.chunks for c in chunks if id(c) not in sliced}
            only = rest if only is None else only & rest
        restore = self._snapshot_untouched(received, only, late)
        self.optimizer.step()
        self._restore_untouched(restore)
        if late:
            self.step_counts.step_late(self, late, only)
        if sliced:
            for chunk, grad in hidden:
                chunk.grad = grad
            self.step_counts.step_sliced(self, sliced)

    # -- parameters without a gradient ---------------------------------------------------------

    def _snapshot_untouched(self, received: Optional[torch.Tensor], only: Optional[set] = None,
                            late: AbstractSet[int] = frozenset()):
        """Save master and state slices of parameters that got no gradient (torch would skip them) and of the
        `late` ones (stepped afterwards with their own counts); `only`: ids of the chunks being stepped (None: all)."""
        flags = received.tolist() if received is not None else None
        if (flags is None or all(flags)) and not late:
            return []
        saved, offset = [], 0
        for index, unit in enumerate(self.units):
            lo, offset = offset, offset + len(unit.layout.shapes)
            if self.whole[index]:
                continue  # whole tensors: the parameter's .grad is None, torch skips it
            if (flags is None or all(flags[lo:offset])) and not any(lo <= i < offset for i in late):
                continue
            for chunk, pieces in self.pieces.of_unit[index]:
                if only is not None and id(chunk) not in only:
                    continue  # not stepped here (another window, or stepped slice by slice)
                state = None
                for piece in pieces:
                    i = lo + piece.param
                    if (flags is None or flags[i]) and i not in late:
                        continue
                    if state is None:
                        state = self.optimizer.state.get(chunk, {})
                    csl = slice(piece.start, piece.stop)
                    tensors = {k: v[csl].clone() for k, v in state.items()
                               if torch.is_tensor(v) and v.shape == chunk.shape}
                    saved.append((chunk, csl, chunk[csl].clone(), tensors))
        return saved

    def _restore_untouched(self, saved) -> None:
        for chunk, csl, value, tensors in saved:
            chunk[csl].copy_(value)
            for k, v in self.optimizer.state.get(chunk, {}).items():
                if torch.is_tensor(v) and v.shape == chunk.shape:
                    # state created by this very step starts from zero for untouched parameters
                    v[csl].copy_(tensors[k]) if k in tensors else v[csl].zero_()

    # -- accounting ----------------------------------------------------------------------------

    @property
    def overflow(self) -> bool:
        """The last step was skipped (fp16 overflow, or a NaN/Inf norm under `nonfinite: skip`): DeepSpeed's ZeRO
        optimizer's `overflow`, which Accelerate reads to hold back a scheduler it steps on the user's optimizer."""
        return self.last_step_skipped

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank: fp32 masters (when separate) plus moments."""
        total = 0 if self.placement.masters_are_shards else sum(m.numel() * m.element_size() for m in self.masters)
        for state in self.optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    total += v.numel() * v.element_size()
        # (a host step's pinned staging buffers are not optimizer state: StepPlan.staging_bytes)
        return total + (self.offload.host_bytes() if self.offload is not None else 0)

    def close(self) -> None:
        """Release the offload tier's stores, files and I/O threads (the engine's close)."""
        if self.offload is not None:
            self.offload.close()

