"""The node layout from the truth (comm/topology.py): ranks grouped by the host they run on, gathered once, with
the launcher's variables only as hints; a disagreement is one warning naming both, and the hosts win.

4 gloo ranks on 2 simulated hosts (ZERODP_HOSTNAME, test_hpz.on_two_hosts)."""

from __future__ import annotations

import os

import torch.distributed as dist

from zerodp.comm import topology
from tests.dist.test_hpz import on_two_hosts
from tests.logged_warnings import zerodp_warnings


def _learn() -> tuple:
    with zerodp_warnings() as warnings:
        before = tuple(topology.node_layout())  # nothing learned yet: the hints
        learned = tuple(topology.learn_hosts())
        return before, learned, tuple(topology.node_layout()), topology.crosses_nodes(None), warnings


def _learn_interleaved() -> tuple:
    os.environ["ZERODP_HOSTNAME"] = f"node{dist.get_rank() % 2}"  # on_two_hosts restores it
    return _learn()


def layout_case(hints: dict, interleaved: bool = False) -> tuple:
    """`interleaved`: ranks 0 and 2 on one host, 1 and 3 on the other (srun's cyclic distribution)."""
    return on_two_hosts(hints, _learn_interleaved if interleaved else _learn)


def test_hosts_win_over_launcher_hints_that_disagree_with_one_warning(dist_run):
    """torchrun's variables say one node of 4 (LOCAL_WORLD_SIZE=4), the hosts say 2 nodes of 2."""
    hints = {"RANK": "{rank}", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "{rank}"}
    results = dist_run(4, layout_case, hints)
    for rank, (before, learned, after, crosses, warnings) in enumerate(results):
        assert before == (4, 1, True), "before the exchange, the hints answer"
        assert learned == after == (2, 2, True) and crosses, "the hosts' layout wins"
        said = [w for w in warnings if "launcher's variables say" in w]
        if rank == 0:
            assert len(said) == 1, warnings
            assert "4 ranks per node" in said[0] and "1 nodes" in said[0] and "LOCAL_WORLD_SIZE=4" in said[0]
            assert "2 on 'node0'" in said[0] and "2 on 'node1'" in said[0] and "ZERODP_HOSTNAME" in said[0]
        else:
            assert said == [], "one warning, on rank 0"


def test_hints_that_agree_give_no_warning(dist_run):
    for hints in ({"RANK": "{rank}", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "{node}"},
                  {"RANK": "{rank}", "WORLD_SIZE": "4", "LOCAL_SIZE": "2", "CROSS_SIZE": "2", "CROSS_RANK": "{node}"},
                  {}):  # no launcher variables at all: the hosts alone
        for before, learned, after, crosses, warnings in dist_run(4, layout_case, hints):
            assert learned == (2, 2, True) and crosses
            assert not [w for w in warnings if "launcher's variables say" in w], (hints, warnings)


def test_ranks_of_a_node_not_numbered_consecutively_are_not_uniform(dist_run):
    """Hosts node0, node1, node0, node1: 2 nodes of 2, but a rank's node is not rank // 2 (hpZ warns, MiCS's two
    hops refuse on such a job)."""
    for _, learned, _, crosses, _ in dist_run(4, layout_case, {}, True):
        assert learned == (2, 2, False) and crosses


def _interleaved(fn, *args):
    os.environ["ZERODP_HOSTNAME"] = f"node{dist.get_rank() % 2}"  # on_two_hosts restores it
    return fn(*args)


def _hpz_warnings() -> list:
    from tests.dist.test_hpz import _engine

    with zerodp_warnings() as warnings:
        _, engine = _engine({"zero_hpz_partition_size": 2})
        engine.close()
    return warnings


def interleaved_hierarchical_case() -> tuple:
    from tests.dist.test_hpz import refusal
    from tests.dist.test_mics import TWO_HOPS

    mics = on_two_hosts({}, _interleaved, refusal, TWO_HOPS)
    hpz = on_two_hosts({}, _interleaved, _hpz_warnings)
    return mics, hpz


def test_hierarchical_modes_on_interleaved_nodes_refuse_or_warn(dist_run):
    """docs/multinode.md: on srun's cyclic numbering MiCS's two hops refuse and hpZ warns (its blocks of
    consecutive ranks span both hosts)."""
    for mics, hpz in dist_run(4, interleaved_hierarchical_case):
        assert "mics_hierarchical_params_gather needs blocks made of whole nodes" in mics
        assert any("do not fit inside nodes" in w for w in hpz), hpz
