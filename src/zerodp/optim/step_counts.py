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
class and group options over views of its master slice, of its gradient slice (as .grad) and of its state slices,
with `step` set to its own count (the same kind of value torch keeps: a tensor like the chunk's `step`, or an
int). torch updates them in place, so nothing is copied in or back. The result is torch's update for that
parameter.
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
from .inner import members, rebuild
from ..optimizers.larc import LARC

# elementwise updates whose only scalar state is `step`: a slice steps on its own exactly as within its chunk
COUNTED = (torch.optim.Adam, torch.optim.AdamW, FusedAdam)


def keeps_counts(member) -> bool:
    """True for an inner optimizer (a member of a list, not the list) whose chunks get per-parameter counts."""
    return type(member) in COUNTED and not isinstance(member, LARC) and getattr(member, "shard_norms", None) is None


class StepCounts:
    """Each parameter's own step count, and each unit's chunk count (module docstring)."""

    def __init__(self, units: list, whole: list[bool], optimizer, group_indices: list[int]) -> None:
        self.units = units
        inner = members(optimizer)
        # a unit's inner group: its user group's position among the kept groups
        self.counted = [not w and keeps_counts(inner[group_indices.index(u.group_index)])
                        for u, w in zip(units, whole)]
        # the units of an optimizer with a step count these counts do not correct (late_starters.py warns of them)
        self.uncorrected = [not w and not c for w, c in zip(whole, self.counted)]
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

    @torch.no_grad()
    def step_late(self, sharded, late: set[int], only: Optional[set] = None) -> None:
        """Step each late parameter's slices of the chunks in `only` (ids; None: all) on its own, with its count.
        `sharded`: the ShardedOptimizer (its `optimizer`, `chunks`, `group_indices`, `_chunk_ranges`); its chunk
        step has run and restored these slices, and the chunks still hold their gradients."""
        inner_groups = sharded.optimizer.param_groups
        owners = members(sharded.optimizer)
        for index, unit in enumerate(self.units):
            if not self.counted[index]:
                continue
            lo = self.offsets[index]
            slices = []
            for seg in unit.layout.segments(unit.shard_index):
                if lo + seg.param_index not in late:
                    continue
                for chunk, csl, _ in sharded._chunk_ranges(index, seg.shard_start, seg.shard_start + seg.numel):
                    if (only is None or id(chunk) in only) and chunk.grad is not None:
                        slices.append((chunk, csl, self.counts[lo + seg.param_index]))
            if slices:
                k = sharded.group_indices.index(unit.group_index)
                self._step_slices(owners[k], inner_groups[k], sharded.optimizer.state, slices)

    @staticmethod
    def _step_slices(member, group: dict, states, slices: list) -> None:
        """One temporary optimizer (same class and group options) over `slices`, each with its count. The slices are
        views of the chunks, of their gradients and of their states (made under no_grad: leaves that need no
        gradient), so torch's in-place update lands in the chunks themselves: no copy in, none back."""
        leaves = []
        for chunk, csl, _ in slices:
            leaf = chunk[csl]
            leaf.grad = chunk.grad[csl]
            leaves.append(leaf)
        options = {k: v for k, v in group.items() if k != "params"}
        temp = rebuild(member, [dict(options, params=leaves)])
        for leaf, (chunk, csl, count) in zip(leaves, slices):
            state = states.get(chunk, {})
            if not state:
                continue  # the chunk has no state yet: the slice starts fresh, as torch's would (its state is dropped)
            own = {k: v[csl] for k, v in state.items() if torch.is_tensor(v) and v.shape == chunk.shape}
            step = state.get("step")
            # torch's kind of `step` (a CPU float tensor; on the device for fused/capturable): filled, not shared
            own["step"] = torch.full_like(step, float(count)) if torch.is_tensor(step) else type(step)(count)
            temp.state[leaf] = own
        temp.step()

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
