"""ZeRO++'s quantized collectives (Wang et al. 2023, arXiv 2306.10209), opt-in approximations:

qwZ  `all_gather_quantized`: every rank quantizes its shard to int8 in blocks (comm/quantize.py) and
     the payloads are all-gathered; each rank dequantizes every shard, its own included, so every
     rank computes with the same weights. Bytes: ~1/4 of fp32's, ~1/2 of bf16's.
qgZ  `reduce_scatter_quantized`: every rank quantizes each of the N destination slices of its full
     gradient to int4 and sends slice r to rank r in one all-to-all; rank r dequantizes the N slices
     it received and sums them in fp32, in rank order (the same order on every rank). Bytes: ~1/8
     of fp32's. (The paper's hierarchical form reduces inside a node first; one hop here.)

Both return a handle whose wait() finishes the operation (the dequantization runs there). Errors
per element: see comm/quantize.py; the reduction adds N such errors, each bounded by its sender's
block maximum / 14.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import quantize as q
from .collectives import Handle, ProcessGroup, all_gather, all_to_all, get_rank, get_world_size

WEIGHT_BITS, GRAD_BITS = 8, 4
BLOCK_NUMEL = 256  # DeepSpeed's default quantization group is of this order: scales cost 4/256 byte per element


class _Finishing(Handle):
    """A pending quantized collective: waits on the inner exchange, then dequantizes once."""

    def __init__(self, inner: Handle, finish: Callable[[], None]) -> None:
        super().__init__(None, lambda: (inner.wait(), finish()))


def _started(inner: Handle, finish: Callable[[], None], async_op: bool) -> Handle:
    """The handle of a quantized collective; waited on here when the caller asked for a blocking one."""
    handle = _Finishing(inner, finish)
    if not async_op:
        handle.wait()
    return handle


def all_gather_quantized(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup = None, *,
                         async_op: bool = False, bits: int = WEIGHT_BITS, block_numel: int = BLOCK_NUMEL,
                         tag: str = "", what: str = "") -> Handle:
    """`all_gather` of `input` into `output` (rank order) through `bits`-bit block quantization."""
    world, shard = get_world_size(group), input.numel()
    if output.numel() != world * shard:
        raise ValueError(f"all_gather_quantized: output has {output.numel()} elements, expected {world} x {shard}")
    mine = q.quantize(input, bits, block_numel)
    payloads = torch.empty(world, mine.numel(), dtype=torch.uint8, device=input.device)
    own = payloads[get_rank(group)]
    own.copy_(mine)
    inner = all_gather(payloads.view(-1), own, group, async_op=True, tag=tag, what=what)
    rows = output.view(world, shard)

    def finish() -> None:
        for r, payload in enumerate(payloads):
            rows[r].copy_(q.dequantize(payload, shard, bits, block_numel, output.dtype))

    return _started(inner, finish, async_op)


def reduce_scatter_quantized(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup = None, *,
                             async_op: bool = False, bits: int = GRAD_BITS, block_numel: int = BLOCK_NUMEL,
                             tag: str = "", what: str = "") -> Handle:
    """`reduce_scatter` (sum) of `input` into this rank's slice `output`, each slice sent in `bits` bits."""
    world, shard = get_world_size(group), output.numel()
    if input.numel() != world * shard:
        raise ValueError(f"reduce_scatter_quantized: input has {input.numel()} elements, expected {world} x {shard}")
    send = torch.cat([q.quantize(part, bits, block_numel) for part in input.view(world, shard)])
    received = torch.empty_like(send)
    inner = all_to_all(received, send, group, async_op=True, tag=tag, what=what)

    def finish() -> None:
        total: Optional[torch.Tensor] = None
        for payload in received.view(world, -1):  # rank order: the same summation on every rank
            part = q.dequantize(payload, shard, bits, block_numel)
            total = part if total is None else total.add_(part)
        output.copy_(total)

    return _started(inner, finish, async_op)
