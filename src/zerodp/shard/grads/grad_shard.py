"""The gradient life cycle of one flat buffer of parameters, the same at every stage: `GradShard`.

A stage 0-2 gradient bucket and a stage-3 flat unit both hold one `GradShard`. As backward produces
each parameter's gradient (a post-accumulate-grad hook, grads/param_hook.py; at stages 0-1 one per
bucket, grads/bucket_intake.py), `add_grad` moves it into the flat full buffer and drops the
parameter's own `.grad`; where the full buffer persists in the parameters' dtype (stages 0-1),
autograd accumulates straight into it instead ([Note: gradients as buffer views]). A reduction
(`launch`, then `wait`) sums the full buffer over ranks, divides by the number of ranks and leaves
this rank's slice in `shard`; the dtypes and divisors are a `grads.grad_arithmetic.GradArithmetic`;
its states and their checked transitions are `grads.grad_state.GradState`.

Policy, not copies (`keep_full`):
- keep_full=True (stages 0 and 1): the full buffer persists and accumulates over micro-steps (in the
  accumulation dtype); the reduction runs in place (or in a copy in the communication dtype, copied
  back) and `shard` is a view of this rank's slice of it.
- keep_full=False (stages 2 and 3): the full buffer exists only from a round's first gradient until
  its reduction is waited on, in the communication dtype (as DeepSpeed's reduction bucket); the
  reduced slice, cast to the accumulation dtype, is added into `shard`, a separate persistent tensor.
How the sum is computed (all-reduce, reduce-scatter, which communicator and stream) is the
`reduce` callable passed at construction.

[Note: reduced shard destination] `_deliver` is the one place where a reduced slice lands in this
rank's gradient shard. With `home` (an offload.ShardStore: stage 3, fp32, offload_param nvme) the
shard lives there between deliveries and the optimizer step (`offloaded`): its storage exists only
inside `resident()`, and `shard_square_norm()` answers from the square norm kept at the last
delivery, so the step need not read every shard twice ([Note: gradient shards offloaded] in
offload/shard_store.py). Without a home both are trivial; callers never ask which. Under ZeRO-Offload on a
GPU the shard's `destination` (chosen once by the engine's composition, engine/grad_path.py) is told around
every delivery and queues the host step's copy (grads/grad_destination.py): the optimizer registers nothing.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, NamedTuple, Optional

import torch

from ... import comm
from ...host_memory import alloc_storage, free_storage
from ..flat.buffer import FlatBuffer
from ..flat.layout import FlatLayout
from .grad_arithmetic import GradArithmetic
from .grad_destination import GradDestination
from .grad_state import ALLOWED as _ALLOWED, GradState
from .split_reduce import SplitReduce

# (output slice, full buffer, async_op) -> handle; sums `full` over ranks, this rank's slice in output
ReduceFn = Callable[[torch.Tensor, torch.Tensor, bool], comm.Handle]


class PendingReduce(NamedTuple):
    """A launched reduction: its handle and the flat tensor it sums (the full buffer's, or its copy in the
    communication dtype, which must live until the handle is waited on)."""

    handle: comm.Handle
    sent: torch.Tensor


class GradShard:
    """The gradients of `params` (laid out by `layout`), and this rank's reduced slice of them."""

    def __init__(self, params: list[torch.nn.Parameter], layout: FlatLayout, shard_index: int,
                 arithmetic: GradArithmetic, reduce: ReduceFn, *, keep_full: bool, name: str = "",
                 home=None, round_views: bool = False) -> None:
        first = params[0]
        self.params = params
        self.layout = layout
        self.shard_index = shard_index
        self.arithmetic = arithmetic  # dtypes and divisors of the reduction
        self.world = arithmetic.world
        self.keep_full = keep_full
        self.name = name              # for error messages
        self._reduce = reduce
        accum_dtype = arithmetic.accum_dtype_for(first.dtype)
        # torch_autocast: the safe modules' gradients are summed in their own dtype; a unit holding both kinds
        # reduces in two collectives (grads/split_reduce.py), the buffer in the other parameters' dtype
        low = [id(p) in arithmetic.low_precision_ids for p in params]
        self.split = SplitReduce(layout, low, arithmetic.low_precision_dtype) if any(low) and not all(low) else None
        self.comm_dtype = arithmetic.comm_dtype_of(next((p for p, is_low in zip(params, low) if not is_low), first))
        if self.split is not None and keep_full:
            raise AssertionError(f"gradient shard {name}: a persistent full buffer cannot mix reduction dtypes "
                                 f"(buckets are split by reduction dtype)")
        self._pending_low: Optional[PendingReduce] = None  # the split's low-dtype reduction in flight
        # per-parameter flags are bytearrays: the hook reads and writes them once per parameter ([Note: hook cost] in
        # grads/param_hook.py)
        # Parameters whose gradient was written into the full buffer since it was allocated (1 per parameter);
        # None: every element holds a value (the persistent buffer, or after `_fill_unwritten`)
        self._written: Optional[bytearray] = None
        self.full = FlatBuffer(layout, accum_dtype if keep_full else self.comm_dtype, first.device)
        # The layout's facts a round reads, taken once: the backward then calls nothing in flat/ per round
        # (bench/results/host_profile.md: a Python call costs about a microsecond on this path)
        self._shard_range = layout.shard_range(shard_index)   # this rank's [lo, hi) of the flat buffer
        self._padded_numel = layout.padded_numel
        self._padding = tuple(layout.padding_ranges())        # elements of no parameter, zeroed before a reduction
        # per parameter, made now while the storage exists (none can be made over a freed one): aliases, not views,
        # so that each has a version counter of its own (flat/buffer.py FlatBuffer.aliases)
        self.views = self.full.aliases()
        if keep_full:
            self._shard = self.full.shard(shard_index)
        else:
            free_storage(self.full.tensor)  # allocated per round, see _ensure_full
            self._shard = torch.zeros(layout.shard_size(shard_index), dtype=accum_dtype, device=first.device)
        # [Note: zeroing on first delivery] zero_grad of a separate in-memory shard (stages 2-3) only marks it: the
        # next delivery copies instead of adding, and reading `shard` before one zeroes it then. A pass over the whole
        # shard per step is saved where every unit is reduced anyway (0.56 ms of the 64-expert MoE's 6 ms step,
        # bench/results/moe_optimizer_step.md); a copied -0.0 stays -0.0 where 0 + -0.0 gave +0.0 (equal as numbers).
        self._zero_pending = False
        self.state = GradState.IDLE
        self._clear_reported()  # _reported (1: the parameter was heard from this round), its count, _closed
        self._received = bytearray(len(params))  # 1: ... since the last optimizer step
        self.rounds_launched = 0                                      # reductions launched this micro-step
        self._stash: Optional[torch.Tensor] = None  # keep_full: earlier rounds' reduced slice
        self._pending: Optional[PendingReduce] = None
        self.home = home if not keep_full else None  # where `shard` lives between uses, or None: in memory
        # [Note: gradients as buffer views] Where the full buffer has the parameters' dtype, each parameter's
        # .grad is its view of the buffer during a backward (as DDP's gradient_as_bucket_view): autograd's
        # AccumulateGrad adds into it in place (`grad += new`, the same add `add_grad` did) and the hook only
        # marks it. The persistent buffer (stages 0-1) is attached before each backward; with `round_views`
        # (stages 2-3, placement.grad_views_every_round) a round's buffer when its first gradient allocates it,
        # zeroed (0 + g is g exactly) and attached to every parameter without a .grad. Detached (.grad = None)
        # when the round's reduction launches, so that a late gradient takes `add_grad`'s path (a new round)
        # instead of landing in a buffer being reduced or freed, and after every backward, so that a stray
        # loss.backward() is refused before it adds anything.
        self.grad_views = ((keep_full or round_views) and self.split is None
                           and all(p.dtype == self.full.dtype for p in params))
        self._sq_norm: Optional[torch.Tensor] = None  # home: the shard's float64 square norm, from its last delivery
        if self.home is not None:
            self.home.adopt(self._shard, zeros=True)

    # -- residency ([Note: reduced shard destination]) ---------------------------------------------

    @property
    def shard(self) -> torch.Tensor:
        """This rank's reduced slice of the gradients (zeros where none arrived since zero_grad)."""
        if self._zero_pending:
            self._shard.zero_()
            self._zero_pending = False
        return self._shard

    @property
    def offloaded(self) -> bool:
        """`shard` has storage only inside `resident()` (it lives in an offload store between uses)."""
        return self.home is not None

    def resident(self) -> ContextManager[None]:
        """Hold `shard` in memory for a block (a no-op when it always is)."""
        return contextlib.nullcontext() if self.home is None else self.home.resident([self._shard])

    def shard_square_norm(self) -> torch.Tensor:
        """The float64 square of `shard`'s 2-norm (`square_norm`), without reading an offloaded shard."""
        if self.home is None:
            return square_norm(self.shard)
        if self._sq_norm is None:  # zeroed since the last step, nothing delivered since
            return torch.zeros((), dtype=torch.float64, device=self._shard.device)
        return self._sq_norm

    def _to(self, state: GradState) -> None:
        if state not in _ALLOWED[self.state]:
            raise RuntimeError(f"zerodp: gradient shard {self.name or '?'} cannot go from {self.state.name} to "
                               f"{state.name} (an engine call out of order?)")
        self.state = state

    @property
    def complete(self) -> bool:
        """Every parameter reported a gradient in this round, or the round was closed (`close_round`)."""
        return self._num_reported == len(self.params) or self._closed

    def close_round(self) -> None:
        """Call this round complete although not every parameter reported: a bucket's trigger fired
        (grads/bucket_intake.py); a gradient still to come is a late one, taken in by another round."""
        self._closed = True

    def end_of_backward(self) -> None:
        """The backward of the module that owns these parameters is over on this rank (stage 3's module unit,
        seen by its inputs hook: shard/stage3/module_unit.py): what did not report has no gradient here and
        takes part with zeros, so that every rank launches this round at the same point of its backward
        ([Note: waiting before the control collective] in grads/reduce_queue.py). A round already launched is
        left alone; a gradient still to come is a late one, taken in by another round."""
        if self.rounds_launched:
            return
        if self.state is GradState.IDLE:  # no gradient at all on this rank: a round of zeros
            self._ensure_full()
            self._to(GradState.FILLING)
        self._closed = True

    @property
    def received(self) -> torch.Tensor:
        """Per parameter (bool): got a gradient since the last optimizer step (or zero_grad)."""
        return torch.tensor(list(self._received), dtype=torch.bool)

    def _clear_reported(self) -> None:
        self._reported = bytearray(len(self.params))
        self._num_reported = 0
        self._closed = False

    @property
    def nbytes(self) -> int:
        """Gradient bytes held now: the full buffer while allocated, plus a separate shard."""
        shard = 0 if self.keep_full else self._shard.numel() * self._shard.element_size()
        if self.home is not None:
            shard -= self.home.offloaded_bytes(self._shard)
        return storage_nbytes(self.full.tensor) + shard

    def _ensure_full(self) -> bool:
        """Give the per-round full buffer memory; True when it was allocated now. Zeroed only for grad views:
        otherwise each parameter's first gradient is copied in (`add_grad`) and only what no gradient wrote is
        zeroed before the buffer is read (`_fill_unwritten`), which saves a pass over a unit's gradient bytes
        per micro-step (1.35 s of a 500m-proxy step's 11.2 s backward, bench/results/big_offload_step.md)."""
        if self.keep_full or storage_nbytes(self.full.tensor) != 0:
            return False
        alloc_storage(self.full.tensor, self._padded_numel)
        if self.grad_views:
            self.full.tensor.zero_()
            self._written = None
        else:
            self._written = bytearray(len(self.params))
        return True

    def _fill_unwritten(self) -> None:
        """Zero the full buffer's parameters that no gradient wrote since it was allocated, and its padding."""
        if self._written is None:
            return
        for view, written in zip(self.views, self._written):
            if not written:
                view.zero_()
        full = self.full.tensor
        for lo, hi in self._padding:  # FlatBuffer.zero_padding's ranges, taken once at construction
            full[lo:hi].zero_()
        self._written = None

    def _open_round(self) -> None:
        """After a reduction, start another round of this micro-step without reducing anything twice."""
        self.wait()
        if self.keep_full:
            # The persistent buffer holds the reduced sums: keep our slice aside, restart from zeros.
            self._stash = self._shard.clone()
            self.full.tensor.zero_()
        self._clear_reported()

    def add_grad(self, index: int) -> None:
        """Move parameter `index`'s fresh `.grad` into the full buffer: the general path of its hook
        (grads/param_hook.py runs the common case, FILLING, inline), and of a late gradient (bucket_intake)."""
        p = self.params[index]
        grad = p.grad
        if grad is None:
            return
        if self.grad_views and grad is self.views[index]:  # accumulated in place (attach_grad_views)
            if self.state is not GradState.FILLING:
                self._to(GradState.FILLING)  # attached only while IDLE or FILLING: never during a reduction
            self._mark(index)
            return
        if self.state is not GradState.FILLING:  # FILLING: the full buffer is allocated
            if self.state is GradState.REDUCING or self.state is GradState.REDUCED:
                self._open_round()  # a late gradient: finish the round in flight, then open another one
            if self._ensure_full():
                self.attach_grad_views()  # the round's other parameters accumulate in place (p has its .grad)
            self._to(GradState.FILLING)
        # In the buffer's dtype: a bf16 gradient is added exactly into an fp32 buffer (type promotion); the
        # first one since the buffer was allocated is copied (the same value as adding it to zeros)
        written = self._written
        if written is not None and not written[index]:
            self.views[index].copy_(grad)
            written[index] = 1
        else:
            self.views[index].add_(grad)
        p.grad = None  # the shard holds it now; dropping .grad is what frees the per-parameter copy
        self._mark(index)

    def mark_many(self, arrived: bytes) -> None:
        """Every parameter whose byte in `arrived` is 1 got its gradient into the buffer (autograd added it into its
        alias: bucket_intake's scan). The flags are OR-ed as integers, in C: a call per parameter costs a frame each."""
        if self.state is GradState.IDLE:
            self._to(GradState.FILLING)
        n = len(arrived)
        new = int.from_bytes(arrived, "little")
        self._reported = bytearray((int.from_bytes(self._reported, "little") | new).to_bytes(n, "little"))
        self._num_reported = self._reported.count(1)
        self._received = bytearray((int.from_bytes(self._received, "little") | new).to_bytes(n, "little"))

    @property
    def reported(self) -> bytes:
        """Per parameter: 1 if heard from in this round."""
        return bytes(self._reported)

    last_reported = -1  # the parameter heard from last in a micro-step's first round (bucket_intake learns from it)

    def _mark(self, index: int) -> None:
        if not self._reported[index]:
            if not self.rounds_launched:
                self.last_reported = index
            self._reported[index] = 1
            self._num_reported += 1
        self._received[index] = 1

    def attach_grad_views(self) -> None:
        """Each parameter without a .grad gets its view of the full buffer as .grad ([Note: gradients as buffer
        views]): before a backward where the buffer persists, when a round's first gradient allocates it
        otherwise; nothing where the buffer cannot be one, is being reduced or has no memory."""
        if self.grad_views and self.state is not GradState.REDUCING and storage_nbytes(self.full.tensor):
            for p, view in zip(self.params, self.views):
                if p.grad is None:
                    p.grad = view

    def detach_grad_views(self) -> None:
        """Take the buffer views back from the parameters' .grad (none is attached while REDUCING or REDUCED)."""
        if self.grad_views and self.state is not GradState.REDUCING and self.state is not GradState.REDUCED:
            for p, view in zip(self.params, self.views):
                if p.grad is view:
                    p.grad = None

    def launch(self, async_op: bool = True) -> None:
        """Start this round's reduction (every rank must call it, in the same order)."""
        self.detach_grad_views()  # from now on a gradient must not land in the buffer being reduced
        if self.state is GradState.REDUCED:
            self._open_round()  # another rank needs a further round; ours adds nothing new
        self._ensure_full()  # a rank without gradients takes part with zeros
        self._fill_unwritten()
        lo, hi = self._shard_range
        if self.split is not None:  # the low-dtype part first: split() zeroes it in the full buffer
            low = self.arithmetic.to_send(self.split.split(self.full.tensor), self.split.low_dtype)
            self._pending_low = PendingReduce(self._reduce(low[lo:hi], low, async_op), low)
        send = self.arithmetic.to_send(self.full.tensor, self.comm_dtype)  # the full buffer itself, or a copy
        self._pending = PendingReduce(self._reduce(send[lo:hi], send, async_op), send)
        self.rounds_launched += 1
        self._to(GradState.REDUCING)

    def wait(self) -> None:
        """Finish the reduction in flight, if any: average over ranks into `shard`."""
        # any write of `shard` after a delivery follows a wait(): the destination orders it after its reads of it
        if self.destination is not None:
            self.destination.before_write(self._shard)
        if self.state is not GradState.REDUCING:
            return
        pending, self._pending = self._pending, None
        pending.handle.wait()
        # Sum across ranks, then divide (by default): exact for two ranks in fp32, and what a single
        # process computes on the global batch up to summation order.
        lo, hi = self._shard_range
        reduced = self.arithmetic.finish(pending.sent[lo:hi])
        if self.split is not None:
            low, self._pending_low = self._pending_low, None
            low.handle.wait()
            reduced = self.split.merge(reduced, self.arithmetic.finish(low.sent[lo:hi]), self._shard_range)
        if self.keep_full and pending.sent is not self.full.tensor:
            reduced = self._shard.copy_(reduced)  # reduced in the communication dtype; the copy is dropped
        elif not self.keep_full:
            reduced = reduced.to(self._shard.dtype)  # cast first, then add: DeepSpeed's order of roundings
        self._deliver(reduced)
        self._to(GradState.REDUCED)

    destination: Optional[GradDestination] = None  # told around each delivery (grads/grad_destination.py)

    def deliver_to(self, destination: GradDestination) -> None:
        """Choose, once and before any backward, where this shard's deliveries also go (grads/grad_destination.py:
        ZeRO-Offload's host staging): `destination.before_write(shard)` at every `wait()` (before anything may write
        `shard` again), `destination.after_write(shard)` after every delivery of a reduced slice into it."""
        if self.destination is not None:
            raise AssertionError(f"gradient shard {self.name or '?'}: its destination is chosen once")
        if self.home is not None:
            raise AssertionError(f"gradient shard {self.name or '?'} rests in an offload store: it is read where it "
                                 f"rests, not copied at its deliveries")
        self.destination = destination

    def _deliver(self, reduced: torch.Tensor) -> None:
        """Put a reduced slice into this rank's shard; see [Note: reduced shard destination]."""
        if self.home is not None:
            with self.home.resident([self._shard], dirty=True):
                self._shard.add_(reduced)
                self._sq_norm = square_norm(self._shard)
            free_storage(self.full.tensor)
        elif not self.keep_full:
            if self._zero_pending:  # the first delivery since zero_grad: 0 + x is x, without a pass of zeros first
                self._shard.copy_(reduced)
                self._zero_pending = False
            else:
                self._shard.add_(reduced)
            free_storage(self.full.tensor)
        elif self._stash is not None:
            reduced.add_(self._stash)  # reduced is `shard` itself
            self._stash = None
        if self.destination is not None:
            self.destination.after_write(self._shard)

    def after_raised_backward(self) -> None:
        """The last backward raised after this shard's round launched: finish the reduction in flight and keep its
        result (stages 0-1: aside, as a late gradient's round does; stages 2-3: delivered into `shard`), so that the
        next backward opens a round of its own and the failed one's gradients count once."""
        if self.state is GradState.REDUCING or self.state is GradState.REDUCED:
            if self.keep_full:
                self._open_round()  # waits, keeps the reduced slice aside, zeroes the buffer
            else:
                self.wait()

    def start_micro_step(self) -> None:
        """Before a backward: forget who reported (gradients keep accumulating)."""
        if self.state is GradState.REDUCING:
            # stages 0-2 finish such a round first (after_raised_backward); stage 3's units stay mid-backward
            raise RuntimeError(f"zerodp: gradient shard {self.name or '?'} still reducing at the start of a "
                               f"backward: the previous engine.backward raised before its end. Stages 0-2 go on from "
                               f"there; stage 3 cannot: load the last checkpoint (engine.load_checkpoint) into a new "
                               f"engine, or fix what raised")
        self._clear_reported()
        self.rounds_launched = 0
        if self.state is not GradState.FILLING:
            self._to(GradState.IDLE)
        self.attach_grad_views()

    def zero_grad(self) -> None:
        """Forget gradients after an optimizer step (or a skipped one)."""
        self.wait()
        if self.state is GradState.FILLING and not self.keep_full:
            self.detach_grad_views()  # a backward that raised left its round open: its buffer is freed below
        if self.keep_full:
            self.full.tensor.zero_()
        elif self.home is not None:
            self.home.zero(self._shard)
            self._sq_norm = None
            free_storage(self.full.tensor)
        else:
            self._zero_pending = True  # [Note: zeroing on first delivery]
            free_storage(self.full.tensor)
        self._received = bytearray(len(self.params))
        self._clear_reported()
        self.rounds_launched = 0
        self._stash = None
        self.state = GradState.IDLE  # from any state: nothing is in flight after wait()


def storage_nbytes(tensor: torch.Tensor) -> int:
    """Bytes allocated behind `tensor` now (0: freed by `free_storage`); FlatBuffer.nbytes without a call into it."""
    return tensor.untyped_storage().size()


def square_norm(grad: torch.Tensor) -> torch.Tensor:
    """The square of `grad`'s 2-norm, as the optimizer sums it over shards (float32 norm, float64 square)."""
    return torch.linalg.vector_norm(grad, dtype=torch.float32).double() ** 2
