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


# shard ranges of unequal length, one empty at 3 ranks (stage 3's whole-tensor units, comm/uneven.py)
UNEVEN = {2: [(0, 5), (5, 12)], 3: [(0, 4), (4, 4), (4, 11)]}


def uneven_exchanges(in_flight: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ranges = UNEVEN[world]
    numel = ranges[-1][1]
    g = torch.Generator().manual_seed(3000 + rank)
    inputs = [torch.randn(numel, generator=g) for _ in range(in_flight)]
    totals, fulls = [], []
    for x in inputs:
        total = x.clone()
        dist.all_reduce(total)
        totals.append(total)
        parts = [torch.empty(numel) for _ in range(world)]
        dist.all_gather(parts, x)  # every rank's whole input; rank r's range of it is what r contributes
        fulls.append(torch.cat([parts[r][a:b] for r, (a, b) in enumerate(ranges)]))
    lo, hi = ranges[rank]
    with comm.record() as log:
        reduced = [torch.full((hi - lo,), float("nan")) for _ in inputs]
        gathered = [torch.full((numel,), float("nan")) for _ in inputs]
        handles = [comm.reduce_scatter_uneven(out, x.clone(), ranges, async_op=True) for out, x in zip(reduced, inputs)]
        handles += [comm.all_gather_uneven(out, x[lo:hi].clone(), ranges, async_op=True)
                    for out, x in zip(gathered, inputs)]
        for h in handles:
            h.wait()
    return {"reduced": reduced, "want_reduced": [t[lo:hi] for t in totals], "gathered": gathered, "want_gathered": fulls,
            "impls": sorted({r.impl for r in log.records})}


@pytest.mark.parametrize("world", [2, 3])
def test_uneven_exchanges_equal_all_reduce_and_all_gather(dist_run, world):
    for r in dist_run(world, uneven_exchanges, 3):
        assert r["impls"] == ["pairwise"]
        for out, want in zip(r["gathered"], r["want_gathered"]):
            assert torch.equal(out, want)
        for out, want in zip(r["reduced"], r["want_reduced"]):
            if world == 2:
                assert torch.equal(out, want)  # a + b either way: bitwise
            else:
                torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
