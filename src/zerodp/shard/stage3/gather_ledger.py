"""`GatherLedger`: proof that every rank gathered the same stage-3 units, in the same order.

[Note: mixed gathers] A stage-3 all-gather only checks sizes. If rank 0 gathers unit A while rank 1
gathers unit B of the same size (a Mixture-of-Experts whose experts are units of their own, routed
differently on each rank), the collective goes through and each rank's "A" is half A and half B:
a wrong model and no error. So every gather of a flat unit on a `ShardGroup` is written here:

    digest  <- (digest * P + index + 1) mod 2^48     (a polynomial hash of the gather sequence)
    count   <- count + 1
    trail   <- trail + [index]                        (kept only to name the modules on a mismatch)

a few integer operations per gather, no tensor and no collective. The ledger is settled (`settle`,
then `verify`) at a collective the step already makes: the control all-reduce that ends every backward
(grads/reduce_queue.py: six more float32 values in it) and, for a forward with autograd off (evaluation,
generation), one small all-reduce when the root's forward ends. Each value v is sent as v and -v under
MAX, so every rank learns the maximum and minimum of every rank's digest and count: they agree iff max
equals min. Every rank reaches the same verdict, so on a mismatch every rank raises (`UnitMismatchError`,
after one `all_gather_object` of the trails, on the error path only) naming, at the first gather where the
trails differ, the module each rank gathered, and the fix. A mismatch is caught before the optimizer
step uses the mixed weights' gradients; the forward and backward that ran on them are lost with the step.

A digest (48 bits, sent as two 24-bit halves: float32 holds them exactly) wrongly agreeing has odds of
2^-48. A mismatch of unequal sizes fails in the all-gather itself (gloo: "Received data size doesn't
match"; NCCL: a hang the watchdog reports); `debug_sync` names every collective's caller for those.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ... import comm
from ...errors import UnitMismatchError

_PRIME = 1_000_003
_MASK = (1 << 48) - 1
_HALF = 1 << 24
SETTLE_NUMEL = 6  # values `settle` adds to a MAX all-reduce: (hi, lo, count) and their negatives


class GatherLedger:
    """The gather sequence of one shard group since the last check (module docstring)."""

    def __init__(self, group: comm.ProcessGroup, device: torch.device) -> None:
        self.group = group                # every rank of the job (the shard group's control group)
        self.device = device              # where `check_now`'s values travel (grads/reduce_queue.control_device)
        self.names: dict[int, str] = {}  # flat unit index -> how diagnostics name it
        self._reset()

    def _reset(self) -> None:
        self.digest = 0
        self.count = 0
        self.trail: list[int] = []

    def register(self, index: int, name: str) -> None:
        """A flat unit exists: remember its name for a mismatch message."""
        self.names[index] = name

    def record(self, index: int) -> None:
        """A gather of flat unit `index` is being issued on this rank."""
        self.digest = (self.digest * _PRIME + index + 1) & _MASK
        self.count += 1
        self.trail.append(index)

    def settle(self) -> list[float]:
        """The values to MAX-reduce with the other ranks' (`verify` reads the result back)."""
        hi, lo, n = float(self.digest // _HALF), float(self.digest % _HALF), float(self.count % _HALF)
        return [hi, lo, n, -hi, -lo, -n]

    def verify(self, reduced: list[float]) -> None:
        """Raise `UnitMismatchError` on every rank if any rank's gather sequence differs; else start afresh.
        `reduced`: `settle()`'s values after a MAX all-reduce over `self.group` (every rank's, same order)."""
        k = SETTLE_NUMEL // 2
        agreed = all(reduced[i] == -reduced[i + k] for i in range(k))
        if agreed:
            self._reset()
            return
        trails: list[Optional[list[int]]] = [None] * comm.get_world_size(self.group)
        dist.all_gather_object(trails, self.trail, group=self.group)  # the error path only: names, not a hash
        self._reset()
        raise UnitMismatchError(self._describe(trails, comm.get_rank(self.group)))

    def check_now(self) -> None:
        """Settle and verify with one small all-reduce of its own (a forward with no backward after it)."""
        if comm.issues_no_collectives(self.group):
            self._reset()
            return
        values = torch.tensor(self.settle(), dtype=torch.float32, device=self.device)
        comm.all_reduce(values, self.group, op=dist.ReduceOp.MAX, tag="control", what="stage-3 gather check")
        self.verify(values.tolist())  # note: a sync point (a forward without backward only)

    def _describe(self, trails: list, rank: int) -> str:
        length = min(len(t) for t in trails)
        first = next((i for i in range(length) if len({t[i] for t in trails}) > 1), length)

        def name(t: list[int]) -> str:
            return self.names.get(t[first], f"flat unit {t[first]}") if first < len(t) else "nothing (no more gathers)"

        lines = "\n".join(f"  rank {r}{' (this rank)' if r == rank else ''} gathered {name(t)}"
                          for r, t in enumerate(trails))
        return (f"zerodp stage 3: ranks gathered different units at gather #{first + 1} of this step; where the sizes "
                f"agree the all-gather mixes two modules' weights, so the step was stopped before the optimizer "
                f"used them:\n{lines}\n"
                f"Every rank must gather the same units in the same order; a module called only for some inputs "
                f"(an expert reached by no token) must not be a unit of its own. Fix: keep the module that calls "
                f"it whole, e.g. zero_optimization.stage3_unit_modules=['<its block class>'] or "
                f"deepspeed.utils.set_z3_leaf_modules(model, [<its block class>]), or leave "
                f"stage3_unit_min_params unset so the default keeps the model's repeated blocks whole "
                f"(docs/moe.md). For collectives other than gathers, debug_sync names every rank's caller.")
