"""Communicators over a subgroup, made and given back again and again in one process (engines built and
closed over a data-parallel group of a tensor-parallel job, MiCS blocks): each new one connects to its live
peers, never to a dead one's ports ([Note: local communicators] in comm/local_groups.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerodp import comm


def remake_twins(rounds: int) -> list:
    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both, in one order
    mine = halves[rank // 2]
    sums = []
    for i in range(rounds):
        twin = comm.new_group_like(mine)
        t = torch.tensor([float(rank + i)])
        dist.all_reduce(t, group=twin)
        sums.append(t.item())
        comm.destroy_group(twin, made_from=mine)
    for g in halves:
        dist.destroy_process_group(g)
    return sums


def test_a_subgroups_communicator_can_be_made_again_after_it_was_given_back(dist_run):
    for rank, sums in enumerate(dist_run(4, remake_twins, 6)):
        base = 1.0 if rank < 2 else 5.0  # ranks 0+1 or 2+3
        assert sums == [base + 2 * i for i in range(6)]
