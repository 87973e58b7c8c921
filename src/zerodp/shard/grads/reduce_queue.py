"""The order in which gradient shards are reduced, and the one control collective that ends a backward.

Both sharding strategies (stage 0-2 buckets, stage-3 flat units) reduce through a `ReduceQueue`:

    start(order)        before backward: the order every rank issues reductions in this micro-step
    launch_ready()      from a gradient hook: launch, in order, every shard that is complete
    finish(boundary)    after backward: agree with every rank on the rounds each shard needs, run
                        them round by round in order, wait for everything

[Note: collective order] Reductions are launched strictly in queue order (shard i only after
0..i-1), as DDP does. Readiness may differ between ranks (a rank whose batch leaves a parameter
unused completes that shard later); the order of collectives then still matches on every rank,
which gloo and NCCL require (a mismatch hangs or silently mixes tensors).

The control collective (one small MAX all-reduce, note: a sync point) carries, per shard, how many
reduction rounds it needs this micro-step (rounds already launched, plus one if gradients arrived
after the last launch), and at an accumulation boundary one flag per parameter: whether it got a
gradient on any rank since the last optimizer step (the optimizer leaves the others untouched).
At stage 3 it also carries the digest of the micro-step's gathers (an `Agreement`, verified before
any round runs: [Note: mixed gathers] in stage3/gather_ledger.py), at no extra collective.

Policy (`reduce_all`): stages 0-2 reduce every bucket at every reducing micro-step, gradient or not,
as DDP does, so their remaining buckets are launched before the control collective; stage 3 skips
a unit that no rank touched, so it agrees first and launches after.

[Note: waiting before the control collective] Bounding the reductions in flight (`max_inflight`) means
waiting on the oldest one inside backward. That wait finishes only when every other rank has launched
the same reduction. At stages 0-2 every rank launches every bucket before the control collective, so it
does. At stage 3 a rank launches a unit after the control collective when the unit was not complete
there in backward (a Mixture-of-Experts rank whose batch sent no token to one of the unit's experts),
while another rank, where the same unit was complete, waited on it in backward: each waited on the
other (issue 42's hang at step 6). So stage 3 says per shard whether every rank is bound to launch it
during backward (`launched_in_backward_everywhere`: its module unit's backward end is seen by an inputs
hook on every rank, and there its round is closed, shard/stage3/module_unit.py), and the queue waits
before the control collective only on such shards; past one it may not wait on, it launches nothing
more until `finish` (the collectives' order is kept; memory is bounded by the units held, not by the bound).

[Note: the control collective's one read] The agreement has to reach the host (the round loop below
is Python), so with NCCL it is a device sync: the host waits for the whole backward queued so far.
It is read once (`tolist`), rounds and received flags together (the flags were a second read,
`.cpu()`, before). It cannot be skipped at world size > 1: whether another rank had a late gradient
(a weight used in two re-entrant checkpointed regions, a hook that fired after its bucket launched)
or left a parameter unused is known only to that rank, and a round one rank runs alone hangs the
others (or, NCCL, silently mixes the next collective's tensors: [Note: collective order]). It is
cheaper on a CPU backend: where the group also reduces CPU tensors (gloo, DeepSpeed's
"cpu:gloo,cuda:nccl") the flags stay on the host (`control_device`) and the exchange waits for the
other ranks' hosts, not for this rank's GPU (zerodp's own groups on a GPU are NCCL alone:
comm/process_group.py). With one rank and collectives skipped there is nobody to agree with: the
local counts are the answer, and no tensor is built, sent or read.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional, Protocol

import torch
import torch.distributed as dist

from ... import comm
from .grad_shard import GradShard, GradState

# Reductions in flight during backward, at stages 1-3 (overlap_comm): each holds its full gradient buffer
# and, on gloo, the exchange's receive buffer until it is waited on. Two keep the collective busy
# while backward computes the next; unbounded, stage 2 kept every bucket's full buffer to the end of
# backward (the benchmark GPT: 128 MiB of full gradients and 64 MiB of receive buffers, peak live
# 660 -> 638 MiB per rank with the bound).
MAX_INFLIGHT = 2


def control_device(group: comm.ProcessGroup, device: torch.device) -> torch.device:
    """Where the control flags travel: the host where `group` reduces CPU tensors (gloo, or DeepSpeed's
    "cpu:gloo,cuda:nccl"), so that agreeing waits for the other ranks' hosts and not for this rank's GPU
    ([Note: the control collective's one read]); else `device` (NCCL alone reduces CUDA tensors only)."""
    return torch.device("cpu") if comm.gloo_serves_cpu(comm.backend_name(group)) else torch.device(device)


class Agreement(Protocol):
    """Values some other part wants every rank to agree on, carried by the control collective (MAX-reduced):
    stage 3's gather check (stage3/gather_ledger.py)."""

    def settle(self) -> list[float]: ...

    def verify(self, reduced: list[float]) -> None: ...


class ReduceQueue:
    """Launches the reductions of `GradShard`s in one order on every rank (module docstring)."""

    def __init__(self, process_group: comm.ProcessGroup, device: torch.device, *, async_op: bool,
                 max_inflight: Optional[int], reduce_all: bool,
                 launched_in_backward_everywhere: Optional[Callable[[GradShard], bool]] = None) -> None:
        self.process_group = process_group
        self.device = control_device(process_group, device)  # the control collective's (NCCL alone: CUDA)
        self.async_op = async_op
        self.max_inflight = max_inflight  # None: unbounded; 0: wait for each at once
        self.reduce_all = reduce_all
        # None: every shard may be waited on in backward (stages 0-2); see [Note: waiting before the control collective]
        self.launched_in_backward_everywhere = launched_in_backward_everywhere
        self.order: list[GradShard] = []
        self._next = 0
        self._inflight: collections.deque[GradShard] = collections.deque()

    def start(self, order: list[GradShard]) -> None:
        """Fix this micro-step's reduction order (the same on every rank) before backward."""
        self.order = order
        self._next = 0
        self._inflight.clear()
        for g in order:
            g.start_micro_step()

    def _launch(self, g: GradShard) -> None:
        """Launch `g` after the control collective (or at stages 0-2), keeping at most `max_inflight` in flight."""
        g.launch(self.async_op)
        self._inflight.append(g)
        while self.max_inflight is not None and len(self._inflight) > self.max_inflight:
            self._inflight.popleft().wait()

    def _settle_in_backward(self) -> bool:
        """Wait for the oldest reductions until at most `max_inflight` are in flight, but only on shards every rank
        launches in backward; False when that leaves more in flight ([Note: waiting before the control collective])."""
        if self.max_inflight is None:
            return True
        everywhere = self.launched_in_backward_everywhere
        while len(self._inflight) > self.max_inflight:
            if everywhere is not None and not everywhere(self._inflight[0]):
                return False  # and nothing after it either: a peer launches the later ones after it
            self._inflight.popleft().wait()
        return True

    def launch_ready(self) -> None:
        """Launch, in order, every shard whose gradients are all in (stops at the first that is not)."""
        while self._next < len(self.order):
            g = self.order[self._next]
            if not (g.complete and g.state is GradState.FILLING and g.rounds_launched == 0):
                break
            if not self._settle_in_backward():
                return  # held until `finish`, in order
            g.launch(self.async_op)
            self._inflight.append(g)
            self._next += 1
        self._settle_in_backward()

    def finish(self, boundary: bool, units: list[GradShard],
               agreement: Optional[Agreement] = None) -> Optional[torch.Tensor]:
        """After backward: run every remaining round on every rank and wait for all of them.

        At an accumulation boundary, returns per-parameter flags (`units` concatenated, in their
        order) saying whether the parameter got a gradient on any rank since the last step.
        `agreement`: its values ride in the control collective and are verified before any round runs.
        """
        order = self.order
        if self.reduce_all:
            for g in order[self._next:]:
                self._launch(g)
            self._next = len(order)
        need = [g.rounds_launched + (1 if g.state is GradState.FILLING else 0) for g in order]
        received = [g.received for g in units] if boundary else []
        if comm.issues_no_collectives(self.process_group):
            # One rank, collectives skipped: the agreement is this rank's own counts. Nothing goes through the
            # device, so nothing is read back from it ([Note: the control collective's one read]).
            target = need
            agreed = (torch.cat(received) if received else torch.zeros(0, dtype=torch.bool)) if boundary else None
            if agreement is not None:
                agreement.verify(agreement.settle())  # alone: agrees with itself
        else:
            extra = agreement.settle() if agreement is not None else []
            flags = torch.cat([torch.tensor(need, dtype=torch.float32)] + [r.float() for r in received]
                              + [torch.tensor(extra, dtype=torch.float32)])
            flags = flags.to(self.device)
            comm.all_reduce(flags, self.process_group, op=dist.ReduceOp.MAX, tag="control")
            # note: a sync point, the step's only one in this method ([Note: the control collective's one read])
            read = flags.tolist()
            if agreement is not None:  # before any round: a mismatch stops every rank here, all together
                agreement.verify(read[len(read) - len(extra):])
            values = [int(v) for v in read[:len(read) - len(extra)]]
            target = values[:len(order)]
            agreed = torch.tensor(values[len(order):], dtype=torch.bool) if boundary else None
        for round_ in range(1, max(target, default=0) + 1):  # round-major: the same sequence on every rank
            for g, rounds in zip(order, target):
                if g.rounds_launched < round_ <= rounds:
                    g.wait()
                    self._launch(g)
        for g in order:
            g.wait()
        self._inflight.clear()
        return agreed
