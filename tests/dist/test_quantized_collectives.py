"""ZeRO++'s quantized collectives (comm/quantized.py) at 2 and 3 gloo ranks: the results are exactly
what each rank's quantized payload carries (dequantized and, for the reduction, summed in rank order),
so within the per-block bound of the exact collective; and they move a quarter (int8 weights) and an
eighth (int4 gradients) of fp32's bytes, as the traffic recorder sees them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zerodp import comm
from zerodp.comm import quantize as q
from zerodp.comm.quantized import BLOCK_NUMEL, all_gather_quantized, reduce_scatter_quantized

SHARD = 1000  # not a multiple of the block: the last block is padded


def rank_tensor(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(numel, generator=g) * torch.logspace(-2, 1, numel)


def quantized_collectives() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = torch.empty(world * SHARD)
    with comm.record() as log:
        all_gather_quantized(gathered, rank_tensor(rank, SHARD))
        full = rank_tensor(rank, world * SHARD)
        reduced = torch.empty(SHARD)
        reduce_scatter_quantized(reduced, full)
    return {"gathered": gathered, "reduced": reduced,
            "bytes": {r.op: r.numel * r.dtype.itemsize for r in log.records}}


@pytest.mark.parametrize("world", [2, 3])
def test_quantized_collectives_carry_exactly_the_payloads(dist_run, world):
    for rank, r in enumerate(dist_run(world, quantized_collectives)):
        for src in range(world):
            exact = rank_tensor(src, SHARD)
            want = q.dequantize(q.quantize(exact, 8, BLOCK_NUMEL), SHARD, 8, BLOCK_NUMEL)
            got = r["gathered"][src * SHARD:(src + 1) * SHARD]
            assert torch.equal(got, want), f"rank {rank}: shard of rank {src}"
            assert (got - exact).abs().max() <= exact.abs().max() / 254 * (1 + 1e-6)
        fulls = [rank_tensor(src, world * SHARD)[rank * SHARD:(rank + 1) * SHARD] for src in range(world)]
        want = sum(q.dequantize(q.quantize(f, 4, BLOCK_NUMEL), SHARD, 4, BLOCK_NUMEL) for f in fulls)
        assert torch.equal(r["reduced"], want), f"rank {rank}: reduction"
        bound = sum(f.abs().max() / 14 for f in fulls) * (1 + 1e-6)
        assert (r["reduced"] - sum(fulls)).abs().max() <= bound
        # bytes: int8 + a 4-byte scale per 256 elements; int4 the same way (fp32 would be 4 bytes each)
        assert r["bytes"]["all_gather"] == world * q.payload_numel(SHARD, 8, BLOCK_NUMEL)
        assert r["bytes"]["all_to_all"] == world * q.payload_numel(SHARD, 4, BLOCK_NUMEL)
        assert r["bytes"]["all_gather"] < 0.27 * 4 * world * SHARD
        assert r["bytes"]["all_to_all"] < 0.14 * 4 * world * SHARD
