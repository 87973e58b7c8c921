"""ZeRO++ hpZ (`zero_hpz_partition_size`): secondary shards inside a node ([Note: secondary shards]).

4 gloo ranks as 2 nodes x 2 (2 simulated hosts, ZERODP_HOSTNAME, and torchrun's variables saying so), hpZ blocks
of 2:
- placement only, so exact: the stage-3 parity cases where gathers are subtle (a module called twice,
  tied embeddings, a frozen unit, activation checkpointing that re-gathers inside backward, gradient
  accumulation: 2 micro-steps per step) equal plain single-process PyTorch with the same tolerance as
  plain stage 3 (test_stage3_parity's `assert_matches`);
- it does what it is for: the traffic recorder sees the same gathers, but the backward's (and, under
  gradient accumulation, the later micro-steps' forwards) inside the node, so inter-node parameter
  bytes are at most half of plain stage 3's;
- checkpoints are plain stage 3's: an hpZ run's checkpoint resumes as plain stage 3 on 3 ranks and a
  plain one as hpZ on 4, with the full parameters equal to the saved ones and training going on.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import zerodp
from zerodp import comm
from zerodp.comm import topology
from tests.dist import common
from tests.dist.test_stage3_parity import CASES, assert_matches, full_state, make, reference_case, zerodp_case

HPZ = {"zero_hpz_partition_size": 2}


def on_two_hosts(hints: dict, fn, *args, **kwargs):
    """Run `fn` with this rank on simulated host node<rank // 2> (ZERODP_HOSTNAME: the node layout comes from the
    hosts, comm/topology.py) and the launcher's variables `hints` set; both undone after, and the hosts forgotten
    (the pooled workers run other cases on one host)."""
    rank = dist.get_rank()
    env = {"ZERODP_HOSTNAME": f"node{rank // 2}", **{k: v.format(rank=rank, node=rank // 2) for k, v in hints.items()}}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn(*args, **kwargs)
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
        topology.forget_hosts()


TORCHRUN_HINTS = {"RANK": "{rank}", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "{node}"}
# DeepSpeed's per-node launch (launcher/launch.py): LOCAL_SIZE and CROSS_RANK/CROSS_SIZE, no LOCAL_WORLD_SIZE
DEEPSPEED_HINTS = {"RANK": "{rank}", "WORLD_SIZE": "4", "LOCAL_SIZE": "2", "CROSS_RANK": "{node}", "CROSS_SIZE": "2"}


def _as_two_nodes(fn, *args, **kwargs):
    """Run `fn` as 2 nodes x 2: 2 simulated hosts, torchrun's variables saying the same."""
    return on_two_hosts(TORCHRUN_HINTS, fn, *args, **kwargs)


def hpz_case(name: str, zero: dict) -> tuple:
    """The parity case on this rank, with its inter- and intra-node parameter-gather bytes."""
    with comm.record() as log:
        losses, state = _as_two_nodes(zerodp_case, name, zero=zero)
    gathers = [r for r in log.records if r.op == "all_gather" and r.tag == "param"]
    inter = sum(r.volume_bytes for r in gathers if r.crosses_nodes)
    intra = sum(r.volume_bytes for r in gathers if not r.crosses_nodes)
    return losses, state, inter, intra, log.volume_bytes(True)


# gpt_tied clips with SGD (a norm summed over the wrong ranks fails it; Adam would hide it), the others gather
# inside backward (recompute) and call a module twice
@pytest.mark.parametrize("name", ["gpt_tied", "frozen_embedding", "checkpoint_reentrant", "checkpoint_non_reentrant"])
def test_hpz_matches_pytorch_and_keeps_backward_gathers_in_the_node(dist_run, name):
    results = dist_run(4, hpz_case, name, HPZ)
    ref_losses, ref_state, _ = reference_case(name, 4)
    assert_matches([(losses, state) for losses, state, *_ in results], ref_losses, ref_state)
    plain = dist_run(4, hpz_case, name, {})
    for (_, _, inter, intra, total), (_, _, inter0, intra0, total0) in zip(results, plain):
        assert intra0 == 0 and inter0 > 0, "plain stage 3 gathers over all 4 ranks, across the 2 nodes"
        assert inter + intra == inter0, "hpZ gathers the same units, of the same size, only elsewhere"
        assert total < total0, "hpZ did not reduce the inter-node bytes"
        if name != "checkpoint_reentrant":  # its forward runs without autograd: no secondary shard is kept then
            # per step, only the first micro-step's forward gathers cross nodes; the backward's and the second
            # micro-step's (gradient accumulation: the same parameters) stay inside: at most half of plain's
            assert inter <= inter0 / 2, (inter, inter0)


# -- checkpoints cross-load --------------------------------------------------------------------------------

def _engine(zero: dict):
    model = common.make_model()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "stage3_unit_min_params": 100,
                                                                         "stage3_param_persistence_threshold": 0, **zero}}
    return model, zerodp.initialize(model, common.make_optimizer("adamw", model), config)


def save_after_training(path: str, zero: dict) -> dict:
    def run():
        model, engine = _engine(zero)
        common.train_steps(engine, 3, 2)
        engine.save_checkpoint(path, tag="t")
        state = full_state(model)
        engine.close()
        return state
    return _as_two_nodes(run)


def load_and_train(path: str, zero: dict) -> tuple[dict, list]:
    def run():
        model, engine = _engine(zero)
        engine.load_checkpoint(path, tag="t")
        state = full_state(model)
        losses = common.train_steps(engine, 2, 2, first_step=3)
        engine.close()
        return state, losses
    return _as_two_nodes(run)


@pytest.mark.parametrize("saved_as, loaded_as", [((4, HPZ), (3, {})), ((2, {}), (4, HPZ))])
def test_hpz_checkpoints_load_as_plain_stage3_and_back(dist_run, tmp_path, saved_as, loaded_as):
    path = str(tmp_path / "ckpt")
    saved = dist_run(saved_as[0], save_after_training, path, saved_as[1])[0]
    for state, losses in dist_run(loaded_as[0], load_and_train, path, loaded_as[1]):
        for key, value in saved.items():
            assert torch.equal(state[key], value), f"{key} changed through save/load"
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] * 1.5


def refusal(zero: dict) -> str:
    try:
        _engine(zero)
    except zerodp.ConfigError as e:
        return str(e)
    return "accepted"


def test_hpz_partition_size_must_divide_the_world(dist_run):
    for message in dist_run(4, refusal, {"zero_hpz_partition_size": 3}):
        assert "zero_hpz_partition_size=3 does not divide the 4 ranks" in message
