"""comm.reduce_scatter and comm.all_gather on gloo are pairwise exchanges (comm/pairwise.py): the
reduction leaves every rank its slice of the sum, equal to an all-reduce's (bitwise at two ranks), the
gather equals gloo's all_gather bitwise; several exchanges in flight at once, this rank's slice given
in place or as a separate tensor."""

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


def gathers_in_flight(shard_numel: int, in_flight: int, in_place: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(2000 + rank)
    shards = [torch.randn(shard_numel + k, generator=g) for k in range(in_flight)]
    expected = []
    for s in shards:
        full = torch.empty(world * s.numel())
        dist.all_gather_into_tensor(full, s)
        expected.append(full)
    with comm.record() as log:
        outputs, handles = [], []
        for s in shards:  # all launched before any is waited on
            out = torch.full((world * s.numel(),), float("nan"))
            if in_place:  # the stage 1-2 form: this rank's shard is its own row of the output
                out[rank * s.numel():(rank + 1) * s.numel()] = s
                src = out[rank * s.numel():(rank + 1) * s.numel()]
            else:
                src = s
            outputs.append(out)
            handles.append(comm.all_gather(out, src, async_op=True))
        for h in handles:
            h.wait()
    return {"outputs": outputs, "expected": expected, "impls": sorted({r.impl for r in log.records})}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("in_place", [True, False])
def test_pairwise_all_gather_equals_all_gather(dist_run, world, in_place):
    for r in dist_run(world, gathers_in_flight, 1001, 3, in_place):
        assert r["impls"] == ["pairwise"]
        for out, want in zip(r["outputs"], r["expected"]):
            assert torch.equal(out, want)
