"""comm.reduce_scatter on gloo is a pairwise exchange (comm/pairwise.py): its result is every rank's
slice of the sum, equal to an all-reduce's (bitwise at two ranks), with several exchanges in flight
at once and this rank's slice given either in place or as a separate tensor."""

import pytest
import torch
import torch.distributed as dist

from zerodp import comm


def exchanges_in_flight(shard_numel: int, in_flight: int, in_place: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1000 + rank)
    # distinct buffers (and sizes) per exchange, so that slices mixed between exchanges would show
    inputs = [torch.randn(world * (shard_numel + k), generator=g) for k in range(in_flight)]
    expected = []
    for x in inputs:
        total = x.clone()
        dist.all_reduce(total)
        n = x.numel() // world
        expected.append(total[rank * n:(rank + 1) * n].clone())
    with comm.record() as log:
        outputs, handles = [], []
        for x in inputs:  # all launched before any is waited on
            n = x.numel() // world
            out = x[rank * n:(rank + 1) * n] if in_place else torch.empty(n)
            outputs.append(out)
            handles.append(comm.reduce_scatter(out, x, async_op=True))
        for h in handles:
            h.wait()
    return {"outputs": [o.clone() for o in outputs], "expected": expected,
            "impls": sorted({r.impl for r in log.records})}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("in_place", [True, False])
def test_pairwise_reduce_scatter_equals_all_reduce_slices(dist_run, world, in_place):
    for r in dist_run(world, exchanges_in_flight, 1001, 3, in_place):
        assert r["impls"] == ["pairwise"]
        for out, want in zip(r["outputs"], r["expected"]):
            if world == 2:
                assert torch.equal(out, want)  # a + b either way: bitwise
            else:
                torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
