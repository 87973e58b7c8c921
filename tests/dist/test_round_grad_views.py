"""Stages 2-3 under the accelerator's gradient policy, run on the CPU (whose own policy is the copy path):
`placement.grad_views_every_round` true, so each round's gradient buffer is zeroed when allocated and handed to
autograd as the parameters' .grad ([Note: gradients as buffer views] in grads/grad_shard.py).

What a GPU runs is checked here without one: the results are bit-identical to the copy path's (0 + g is g) and
match single-process PyTorch, on the models where gradient rounds are unusual (a module called twice; re-entrant
checkpointing, whose late gradients open a second round; frozen and never-called parameters; a tied weight; units
whose order changes between steps, so their first gradients come from other parameters), in
bf16, and a stray loss.backward() is still refused and discarded.
"""

from __future__ import annotations

import pytest
import torch

from zerodp.offload import placement
from zerodp.shard.grads.grad_shard import GradShard
from tests.dist import test_grad_hygiene, test_parity, test_stage3_parity
from tests.dist.common import zerodp_run


def with_round_views(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` on this rank with the accelerator's policy; returns (its result, how many times a
    round's buffer was handed to autograd as views: the policy was in force, not just asked for)."""
    attaches = []
    attach = GradShard.attach_grad_views

    def counting(self) -> None:
        if not self.keep_full and self.grad_views:
            attaches.append(self.name)
        attach(self)
    saved = placement.grad_views_every_round
    placement.grad_views_every_round = lambda device: True
    GradShard.attach_grad_views = counting
    try:
        return fn(*args, **kwargs), len(attaches)
    finally:
        placement.grad_views_every_round = saved
        GradShard.attach_grad_views = attach


def both_policies(fn, *args, **kwargs):
    """This rank's result under the CPU's policy (copies), then under the accelerator's (round views)."""
    return fn(*args, **kwargs), with_round_views(fn, *args, **kwargs)


def assert_identical(copied, viewed) -> None:
    """Losses and every final tensor bit for bit."""
    losses, state = copied
    assert viewed[0] == losses
    for name, value in state.items():
        assert torch.equal(viewed[1][name], value), name


@pytest.mark.parametrize("name", ["called_twice", "checkpoint_reentrant", "parity_net", "gpt_tied", "order_changes"])
def test_stage3_round_views_match_the_copy_path_and_pytorch(dist_run, name):
    world = 2
    results = dist_run(world, both_policies, test_stage3_parity.zerodp_case, name)
    ref_losses, ref_state, _ = test_stage3_parity.reference_case(name, world)
    for copied, (viewed, attaches) in results:
        assert attaches > 0, "the round-views policy did not reach the gradient shards"
        assert_identical(copied, viewed)
    test_stage3_parity.assert_matches([viewed for _, (viewed, _) in results], ref_losses, ref_state)


def test_stage3_bf16_round_views_match_the_copy_path(dist_run):
    # bf16 parameters, bf16 gradient buffers: the views are the parameters' dtype, so the policy applies
    for copied, (viewed, attaches) in dist_run(2, both_policies, test_stage3_parity.zerodp_case, "gpt_tied",
                                               bf16=True):
        assert attaches > 0
        assert_identical(copied, viewed)


def test_stage2_round_views_match_the_copy_path_and_pytorch(dist_run):
    world = 3  # odd: padded buckets
    results = dist_run(world, both_policies, zerodp_run, test_parity.config(2), "adamw", test_parity.STEPS,
                       test_parity.MICRO_BS)
    for copied, (viewed, attaches) in results:
        assert attaches > 0
        assert_identical(copied, viewed)
    test_parity.assert_parity([viewed for _, (viewed, _) in results], "adamw", world)


@pytest.mark.parametrize("stage", [2, 3])
def test_stray_backward_is_refused_under_round_views(dist_run, stage):
    clean = dist_run(2, with_round_views, test_grad_hygiene.stray_backward_run, stage, False)
    stray = dist_run(2, with_round_views, test_grad_hygiene.stray_backward_run, stage, True)
    for (c, _), (s, attaches) in zip(clean, stray):
        assert attaches > 0
        assert s["error"] is not None and "call engine.backward(loss) instead of loss.backward()" in s["error"]
        assert c["params"].keys() == s["params"].keys()
        for key, value in c["params"].items():
            assert torch.equal(value, s["params"][key]), f"{key}: the stray gradient must not reach the next step"
