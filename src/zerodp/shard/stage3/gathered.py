"""`gathered_parameters`: full stage-3 parameters outside forward, for reading or for editing.

    with zerodp.gathered_parameters(model.head.weight):
        reg = 1e-4 * model.head.weight.pow(2).sum()    # a loss term: backward works, see below
    with zerodp.gathered_parameters(model.parameters(), modifier_rank=0):
        if dist.get_rank() == 0:
            model.head.weight.mul_(0.5)                  # rank 0's values become everyone's

It is a collective: every rank must enter it with the same parameters (in any order; they are
gathered in one fixed order), else the ranks hang in the all-gather. Parameters that zerodp does
not partition (small frozen ones, or a model not under stage 3) are accepted and left as they are.

On exit, with `modifier_rank=r`, rank r's full values are broadcast and every rank keeps its
slice as its new shard (and its fp32 master under bf16/fp16), so optimizer and model agree.
Without `modifier_rank`, the block is read-only: writes to sharded parameters are discarded when
the storage is released. If the block raises, no collective runs on exit (the other ranks may not
be there) and the values are not written back.

Parameters built under `init_context` and not yet given to an engine are gathered too (each whole, by
its init context), and on exit every rank keeps its slice of `modifier_rank`'s values (or of its own
without one): this is how transformers initializes a model made under DeepSpeed's `zero.Init` and loads
a checkpoint into it, before the engine exists.

Autograd: a tensor computed inside the block may enter the loss. Tensors that autograd saves from
the gathered storage are marked (saved-tensor hooks), and when backward needs one again the unit
is gathered on the spot and kept until that backward ends (the strategy's finish_micro_step).
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional, Union

import torch

from ... import comm
from ...errors import PartitionedParameterError
from .flat_unit import FlatUnit
from .params import context_of, owner_of


@contextlib.contextmanager
def gathered_parameters(params: Union[torch.Tensor, Iterable[torch.Tensor]],
                        modifier_rank: Optional[int] = None) -> Iterator[None]:
    """Gather `params` (a parameter or an iterable of them) for the block; see the module docstring."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    flats, whole, context = [], [], {}  # context: id(flat) -> the strategy it belongs to
    built = {}  # id(init context) -> (it, its records of `params`): built under init_context, no engine yet
    for p in params:
        flat = owner_of(p)
        if flat is None:
            whole.append(p)
        elif not isinstance(flat, FlatUnit):
            ctx, records = built.setdefault(id(context_of(p)), (context_of(p), []))
            if flat not in records:
                records.append(flat)
        elif id(flat) not in context:
            context[id(flat)] = context_of(p)
            flats.append(flat)
    flats.sort(key=lambda f: (context[id(f)].serial, f.index))
    for strategy in {id(c): c for c in context.values()}.values():
        # Units kept gathered between inference forwards (inference_cache.py) are released first, so
        # that a write in a read-only block is discarded on exit, as documented, instead of living on.
        strategy.release_kept_units()
    for ctx, records in built.values():
        ctx.gather_for_block(records)
    for f in flats:
        f.acquire(wait=False)
    for f in flats:
        f.wait_for_unshard()
    by_storage = {f.gathered.tensor.untyped_storage().data_ptr(): f for f in flats}

    def pack(t: torch.Tensor):
        flat = by_storage.get(_storage_ptr(t))
        return t if flat is None else _SavedView(flat, t)

    def unpack(saved):
        if isinstance(saved, _SavedView):
            context[id(saved.flat)].hold_until_backward_ends(saved.flat)
            return saved.tensor
        return saved

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack) if flats else contextlib.nullcontext()
    finished = False
    try:
        with hooks:
            yield
        finished = True
    finally:
        if finished and modifier_rank is not None:
            for f in flats:
                f.write_back(modifier_rank)
                context[id(f)].on_shard_written(f)  # the engine refreshes the fp32 master from it
            group = flats[0].shards.control_group if flats else None  # modifier_rank: a rank of the job
            for p in whole:
                with torch.no_grad():
                    comm.broadcast(p.data, modifier_rank, group, tag="param")
        for f in flats:
            f.release()
        if finished:  # a collective (the broadcast of modifier_rank's values): skipped if the block raised
            for ctx, records in built.values():
                ctx.release_after_block(records, modifier_rank)


class _SavedView:
    """A tensor autograd saved from gathered storage, with the flat unit to gather again for backward."""

    __slots__ = ("flat", "tensor")

    def __init__(self, flat, tensor: torch.Tensor) -> None:
        self.flat, self.tensor = flat, tensor


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less tensors
        return -1
