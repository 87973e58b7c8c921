"""Per-parameter step counts for Adam-family optimizers stepped over flat chunks: `StepCounts`.

[Note: one step count per parameter] torch's Adam and AdamW keep a step count per parameter: a step where a
parameter has no .grad skips it, count included, and its bias correction (1 - beta^t) uses its own t. zerodp's
inner optimizer steps flat chunks of many parameters (optim/optimizer.py [Note: optimizer chunks]), each chunk
with one `step` in its state; a parameter that got no gradient on any rank is restored around the step
(`_snapshot_untouched`), but its chunk's count advances. Left at that, a parameter that missed a step (an MoE
expert not routed, a branch not taken) would later be bias-corrected with its chunk's count: AdamW's first update
of a parameter first used at step 1000 would be about 2.5 times torch's.

So this keeps each parameter's own count on the host (Python ints, units concatenated like the `received` flags;
the same on every rank, since `received` is agreed globally), and each unit's chunk count beside it. At a step, a
parameter that got a gradient and whose count differs from its chunk's (a "late" parameter) is snapshotted with
the untouched ones, restored after the chunk step, and then stepped on its own: a temporary optimizer of the same
class and group options (built once per group, slice_steps.py) over views of its master slice, of its gradient
slice (as .grad) and of its state slices, with `step` set to its own count (the same kind of value torch keeps: a
tensor like the chunk's `step`, or an int). torch updates them in place, so nothing is copied in or back. The
result is torch's update for that parameter. Once a chunk has state, its slices skip the snapshot altogether
([Note: sliced chunks] below).
Nothing here reads a device value: which parameters are late is decided from host lists (tests/unit/
test_step_syncs.py), and the extra work happens only when one is.

Covered: the elementwise classes whose whole per-parameter scalar state is `step` (COUNTED), outside LARC and
shard-aware norms. Others (LAMB's per-tensor trust ratio, NAdam's mu product) keep one count per chunk and are
warned about (optim/late_starters.py). Whole-tensor units are skipped by torch itself and need none of this.
Checkpoints save the counts by parameter name (checkpoint/save_load.py), so a resume at another world size keeps
them; a checkpoint without them gives every parameter its chunk's count (what zerodp did before).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..optimizers.fused_adam import FusedAdam
from .chunk_pieces import ChunkPieces
from .inner import members
from ..optimizers.larc import LARC
from .slice_steps import SliceSteps

# elementwise updates whose only scalar state is `step`: a slice steps on its own exactly as within its chunk
COUNTED = (torch.optim.Adam, torch.optim.AdamW, FusedAdam)


def keeps_counts(member) -> bool:
    """True for an inner optimizer (a member of a list, not the list) whose chunks get per-parameter counts."""
    return type(member) in COUNTED and not isinstance(member, LARC) and getattr(member, "shard_norms", None) is None


class StepCounts:
    """Each parameter's own step count, and each unit's chunk count (module docstring)."""

    def __init__(self, units: list, whole: list[bool], optimizer, group_indices: list[int],
                 pieces: ChunkPieces) -> None:
        self.units = units
        self.pieces = pieces  # each unit's parameters cut at its chunks (chunk_pieces.py)
        self.slice_steps = SliceSteps()  # the slices' own steps, with what they reuse (slice_steps.py)
        inner = members(optimizer)
        # a unit's inner group: its user group's position among the kept groups
        self.counted = [not w and keeps_counts(inner[group_indices.index(u.group_index)])
                        for u, w in zip(units, whole)]
        # the units of an optimizer with a step count these counts do not correct (late_starters.py warns of them)
        self.uncorrected = [not w and not c for w, c in zip(whole, self.counted)]
        self.counted_units = [k for k, c in enumerate(self.counted) if c]
        self.group_of = [group_indices.index(u.group_index) for u in units]  # each unit's inner group
        self.offsets = [0]
        for unit in units:
            self.offsets.append(self.offsets[-1] + len(unit.params))
        self.unit_of = [k for k, u in enumerate(units) for _ in u.params]
        self.counts = [0] * self.offsets[-1]        # each parameter's own count
        self.chunk_steps = [0] * len(units)         # each unit's chunk count (all its chunks step together)

    @property
    def any_counted(self) -> bool:
        return any(self.counted)

    def late(self, received: Optional[torch.Tensor], corrected: bool = True) -> set[int]:
        """Parameters (indices, units concatenated) that get a gradient now and whose count is not their chunk's, in
        the units whose counts this corrects (`corrected`), or else in those it does not (`uncorrected`).
        `received`: host flags (None: every parameter got one); no device value is read."""
        units = self.counted if corrected else self.uncorrected
        if not any(units):
            return set()
        flags = received.tolist() if received is not None else None
        return {i for i, c in enumerate(self.counts) if units[self.unit_of[i]]
                and (flags is None or flags[i]) and c != self.chunk_steps[self.unit_of[i]]}

    def after_step(self, received: Optional[torch.Tensor]) -> None:
        """A step was taken: every chunk advanced, and each parameter that got a gradient."""
        flags = received.tolist() if received is not None else [True] * len(self.counts)
        self.chunk_steps = [s + 1 for s in self.chunk_steps]
        self.counts = [c + 1 if r else c for c, r in zip(self.counts, flags)]

    # -- the late parameters' own steps --------------------------------------------------------

    def step_late(self, sharded, late: set[int], only: Optional[set] = None) -> None:
        """Step each late parameter's slices of the chunks in `only` (ids; None: all) on its own, with its count.
        `sharded`: the ShardedOptimizer (its `optimizer`); its chunk step has run and restored these slices, and
        the chunks still hold their gradients."""
        by_group: dict[int, list] = {}
        for index in self.counted_units:
            lo, hi = self.offsets[index], self.offsets[index + 1]
            if not any(lo <= i < hi for i in late):
                continue
            slices = by_group.setdefault(self.group_of[index], [])
            for chunk, pieces in self.pieces.of_unit[index]:
                if (only is not None and id(chunk) not in only) or chunk.grad is None:
                    continue
                slices.extend((chunk, slice(p.start, p.stop), self.counts[lo + p.param]) for p in pieces
                              if lo + p.param in late)
        self._step_groups(sharded, by_group)

    # -- chunks stepped slice by slice ([Note: sliced chunks]) -----------------------------------

    def sliced_chunks(self, sharded, received: Optional[torch.Tensor], only: Optional[set] = None) -> dict:
        """[Note: sliced chunks] The chunks of counted units (`only`: ids, None: all) holding a parameter that got no
        gradient or is late, once their state exists: id(chunk) -> (unit index, chunk, [(chunk slice, count)]) for
        their parameters that got a gradient, adjacent ones with the same count merged. Stepping those slices alone
        (`step_sliced`) is torch's update for each of them and leaves the others as torch leaves a parameter without
        .grad, with no snapshot and restore of the untouched ones: a 64-expert MoE's step then costs about what
        the routed experts cost. The other chunks of such a unit, whose parameters all got a gradient and have its
        count, are in the plan too, with None for their slices: stepped whole with their own state in the same call
        (one foreach call per group, not one for them and another for the slices). A unit where every parameter
        got a gradient with its count is left to the inner optimizer's own step; a chunk with no state yet (its
        first step) goes the snapshot way (optim/optimizer.py), which creates its state. Host lists only (the
        pieces of each chunk are computed once: chunk_pieces.py); nothing is read from the device."""
        if not self.counted_units:
            return {}
        flags = received.tolist() if received is not None else None
        counts, states, plan = self.counts, sharded.optimizer.state, {}
        for index in self.counted_units:
            lo, hi = self.offsets[index], self.offsets[index + 1]
            chunk_count = self.chunk_steps[index]
            if (flags is None or all(flags[lo:hi])) and all(c == chunk_count for c in counts[lo:hi]):
                continue  # the whole unit steps with its count: the inner optimizer's own step
            for chunk, pieces in self.pieces.of_unit[index]:
                if only is not None and id(chunk) not in only:
                    continue
                runs, whole = [], True
                for piece in pieces:
                    i = lo + piece.param
                    if flags is not None and not flags[i]:
                        whole = False
                        continue
                    count = counts[i]
                    whole = whole and count == chunk_count
                    if runs and runs[-1][1] == piece.start and runs[-1][2] == count:
                        runs[-1][1] = piece.stop
                    else:
                        runs.append([piece.start, piece.stop, count])
                if "step" not in states.get(chunk, {}):
                    continue
                # None: the chunk steps whole (every parameter got a gradient with its count), in the same
                # foreach call as the slices, with its own state
                plan[id(chunk)] = (index, chunk, None if whole else [(slice(a, b), c) for a, b, c in runs])
        return plan

    def step_sliced(self, sharded, plan: dict) -> None:
        """Step `plan`'s slices (`sliced_chunks`), each with its count, and its whole chunks, then advance each sliced
        chunk's own `step` as the inner optimizer's step would have (the chunk count stays the chunk's `step`:
        loaded_chunk_state); torch advanced the whole ones'."""
        by_group: dict[int, list] = {}
        for index, chunk, slices in plan.values():
            by_group.setdefault(self.group_of[index], []).extend(
                [(chunk, None, None)] if slices is None else [(chunk, csl, count) for csl, count in slices])
        self._step_groups(sharded, by_group)
        steps = []  # the sliced chunks' tensor counts, advanced in one call
        for _, chunk, slices in plan.values():
            if slices is None:
                continue  # stepped whole: torch advanced its `step`
            state = sharded.optimizer.state[chunk]
            step = state["step"]
            if torch.is_tensor(step):
                steps.append(step)
            else:
                state["step"] = step + 1
        if steps:
            torch._foreach_add_(steps, 1)

    def _step_groups(self, sharded, by_group: dict[int, list]) -> None:
        """One step per inner group over its (chunk, slice, count) list (slice_steps.py)."""
        owners = members(sharded.optimizer)
        inner_groups = sharded.optimizer.param_groups
        for k, slices in by_group.items():
            if slices:
                self.slice_steps.step(k, owners[k], inner_groups[k], sharded.optimizer.state, slices)

    # -- checkpoints ---------------------------------------------------------------------------

    def loaded_chunk_state(self, index: int, state: dict) -> None:
        """Unit `index`'s optimizer state was loaded: its chunk count is the state's `step` (0 without state).
        A load, not a step: reading a device `step` here costs nothing the step pays for."""
        step = state.get("step") if state else None
        self.chunk_steps[index] = 0 if step is None else int(step)

    def by_param(self) -> dict[int, int]:
        """id(parameter) -> its count, for the counted units (what a checkpoint saves, by name)."""
        return {id(p): self.counts[self.offsets[k] + j] for k, unit in enumerate(self.units) if self.counted[k]
                for j, p in enumerate(unit.params)}

    def load(self, saved: Optional[dict[int, int]]) -> None:
        """After the units' states are loaded: counts by id(parameter) from `saved`; a parameter not in it (or
        `saved` None: a checkpoint from before per-parameter counts) takes its chunk's count."""
        for k, unit in enumerate(self.units):
            for j, p in enumerate(unit.params):
                i = self.offsets[k] + j
                self.counts[i] = saved[id(p)] if saved is not None and id(p) in saved else self.chunk_steps[k]
