"""MiCS / FSDP2's HSDP (`mics_shard_size`): shard inside blocks, replicate across them ([Note: replicated shards]).

4 gloo ranks as 2 nodes x 2 (2 simulated hosts, test_hpz's _as_two_nodes), blocks of 2 (= HSDP: shard in the node):
- placement only, so exact: the stage-3 parity cases (a module called twice, tied embeddings, a frozen
  unit, both activation checkpointings, gradient accumulation, clipping by the global norm) equal plain
  single-process PyTorch with plain stage 3's tolerance;
- the placement is what it says: each rank holds half of every unit (not a quarter), every parameter
  gather and gradient reduce-scatter stays inside the node, and the only inter-node traffic of a step is
  the replicas' all-reduce of the reduced slices (ZeRO-3 sends every byte across);
- checkpoints are plain stage 3's: a MiCS run resumes as plain stage 3 on 3 ranks and back, parameters
  equal to the saved ones.
"""

from __future__ import annotations


import pytest
import torch

import zerodp
from zerodp import comm
from zerodp.comm import topology
from tests.dist.test_hpz import (DEEPSPEED_HINTS, _as_two_nodes, load_and_train, on_two_hosts, refusal,
                                 save_after_training)
from tests.logged_warnings import zerodp_warnings
from tests.dist.test_stage3_parity import assert_matches, reference_case, zerodp_case

MICS = {"mics_shard_size": 2}


def mics_case(name: str, zero: dict) -> tuple:
    """The parity case on this rank; its traffic by (op, inter-node) and its shard fraction."""
    with comm.record() as log:
        losses, state = _as_two_nodes(zerodp_case, name, zero=zero)
    traffic: dict = {}
    for r in log.records:
        if r.tag in ("param", "grad"):
            key = f"{r.tag}:{r.op}:{'inter' if r.crosses_nodes else 'intra'}"
            traffic[key] = traffic.get(key, 0) + r.volume_bytes
    return losses, state, traffic


def shard_fraction(zero: dict) -> float:
    """Elements of the units this rank keeps, over the units' elements (padded)."""
    def run():
        from tests.dist.test_hpz import _engine
        _, engine = _engine(zero)
        units = engine.sharding.units
        fraction = sum(u.param_shard.numel() for u in units) / sum(u.layout.padded_numel for u in units)
        engine.close()
        return fraction
    return _as_two_nodes(run)


# gpt_tied clips with SGD: a gradient norm summed over the replicas too (each shard counted twice) fails it
@pytest.mark.parametrize("name", ["gpt_tied", "called_twice", "frozen_embedding", "checkpoint_non_reentrant"])
def test_mics_matches_pytorch_and_crosses_nodes_only_to_sum_replicas(dist_run, name):
    results = dist_run(4, mics_case, name, MICS)
    ref_losses, ref_state, _ = reference_case(name, 4)
    assert_matches([(losses, state) for losses, state, _ in results], ref_losses, ref_state)
    if name != "gpt_tied":
        return  # the traffic is a property of the layout: one model shows it
    plain = dist_run(4, mics_case, name, {})
    for (_, _, traffic), (_, _, traffic0) in zip(results, plain):
        inter = {k: v for k, v in traffic.items() if k.endswith(":inter")}
        assert set(inter) == {"grad:all_reduce:inter"}, traffic
        # the same gathers, inside the node (units are padded to a multiple of 2 ranks instead of 4: a few elements less)
        assert traffic["param:all_gather:intra"] == pytest.approx(traffic0["param:all_gather:inter"], rel=0.02)
        assert "grad:reduce_scatter:intra" in traffic
        # the replicas' all-reduce moves each rank's half of the gradients (x2: an all-reduce's volume), so
        # ZeRO-3's inter-node total (gathers + reduce-scatter) is larger than it
        assert inter["grad:all_reduce:inter"] < sum(v for k, v in traffic0.items() if k.endswith(":inter"))


def test_mics_shards_over_the_block_not_the_world(dist_run):
    for fraction, plain in zip(dist_run(4, shard_fraction, MICS), dist_run(4, shard_fraction, {})):
        assert fraction == pytest.approx(1 / 2) and plain == pytest.approx(1 / 4)


@pytest.mark.parametrize("saved_as, loaded_as", [((4, MICS), (3, {})), ((2, {}), (4, MICS))])
def test_mics_checkpoints_load_as_plain_stage3_and_back(dist_run, tmp_path, saved_as, loaded_as):
    path = str(tmp_path / "ckpt")
    saved = dist_run(saved_as[0], save_after_training, path, saved_as[1])[0]
    for state, losses in dist_run(loaded_as[0], load_and_train, path, loaded_as[1]):
        for key, value in saved.items():
            assert torch.equal(state[key], value), f"{key} changed through save/load"
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] * 1.5


@pytest.mark.parametrize("zero, message", [
    ({"mics_shard_size": 3}, "mics_shard_size=3 does not divide the 4 ranks"),
    ({"mics_shard_size": 2, "zero_hpz_partition_size": 2}, "mics_shard_size with zero_hpz_partition_size is not"),
])
def test_mics_refusals_name_the_problem(dist_run, zero, message):
    for got in dist_run(4, refusal, zero):
        assert message in got


TWO_HOPS = {"mics_shard_size": 4, "mics_hierarchical_params_gather": True}


def test_two_hop_gathers_are_exact_and_cross_nodes_with_a_share_of_the_bytes(dist_run):
    """mics_hierarchical_params_gather ([Note: two-hop gathers]): one block of 4 ranks over 2 nodes x 2; the
    gathers go across nodes one shard per node and then inside the node: the same parameters (exact against
    plain PyTorch), half of the one-hop gather's bytes across nodes."""
    results = dist_run(4, mics_case, "gpt_tied", TWO_HOPS)
    ref_losses, ref_state, _ = reference_case("gpt_tied", 4)
    assert_matches([(losses, state) for losses, state, _ in results], ref_losses, ref_state)
    for (_, _, traffic), (_, _, plain) in zip(results, dist_run(4, mics_case, "gpt_tied", {})):
        assert traffic["param:all_gather:inter"] == pytest.approx(plain["param:all_gather:inter"] / 2, rel=0.02)
        assert traffic["param:all_gather:intra"] == pytest.approx(plain["param:all_gather:inter"], rel=0.02)


def _case_and_layout(name: str, zero: dict) -> tuple:
    losses, state = zerodp_case(name, zero=zero)
    return losses, state, tuple(topology.node_layout())


def deepspeed_launch_case(name: str, zero: dict) -> tuple:
    """The parity case under DeepSpeed's per-node launch variables (LOCAL_SIZE, CROSS_RANK/CROSS_SIZE, no
    LOCAL_WORLD_SIZE) on 2 hosts: its losses, state, node layout, inter-/intra-node parameter gather bytes and
    the warnings logged."""
    with zerodp_warnings() as warnings, comm.record() as log:
        losses, state, layout = on_two_hosts(DEEPSPEED_HINTS, _case_and_layout, name, zero)
    gathers = [r for r in log.records if r.op == "all_gather" and r.tag == "param"]
    inter = sum(r.volume_bytes for r in gathers if r.crosses_nodes)
    intra = sum(r.volume_bytes for r in gathers if not r.crosses_nodes)
    return losses, state, layout, inter, intra, warnings


@pytest.mark.parametrize("zero", [TWO_HOPS, {"zero_hpz_partition_size": 2}], ids=["mics_two_hops", "hpz"])
def test_mics_and_hpz_see_two_nodes_under_deepspeeds_launch_variables(dist_run, zero):
    """Issue 41: under DeepSpeed's launch, zerodp saw 1 node of 4, so the two-hop gather did nothing and hpZ's
    cross-node warning never fired. Now: 2 nodes of 2, both gather inside the node where they should, exactly."""
    results = dist_run(4, deepspeed_launch_case, "gpt_tied", zero)
    ref_losses, ref_state, _ = reference_case("gpt_tied", 4)
    assert_matches([(r[0], r[1]) for r in results], ref_losses, ref_state)
    for _, _, layout, inter, intra, warnings in results:
        assert layout == (2, 2, True)
        assert inter > 0 and intra > 0, "some parameter gathers stay inside a node, some cross (2 nodes seen)"
        assert not [w for w in warnings if "launcher's variables say" in w or "hpZ" in w], warnings
