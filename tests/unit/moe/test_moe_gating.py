"""The MoE gate's rules (zerodp/moe/gating.py), no process group: capacity, drops, top-2 renormalization, l_aux,
and the errors for bad options. DeepSpeed 0.19.8 agreement: bench/moe_layer_vs_deepspeed.py."""

import math

import pytest
import torch

from zerodp.moe import MoE, TopKGate
from zerodp.moe.gating import capacity_for, top1_routing, top2_routing


def one_hot_logits(choices, num_experts=4, second=None):
    """Logits whose softmax puts token s's largest value on choices[s] (and the next on second[s])."""
    logits = torch.zeros(len(choices), num_experts)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 3.0
    if second is not None:
        logits[torch.arange(len(choices)), torch.tensor(second)] = 2.0
    return logits


def test_capacity_formula():
    assert capacity_for(24, 4, 1.0, 0) == 6 and capacity_for(24, 4, 1.25, 0) == 8  # ceil(S / E * factor)
    assert capacity_for(3, 4, 1.0, 4) == 4  # min_capacity wins


def test_top1_drops_beyond_capacity_and_weighs_by_the_gate():
    logits = one_hot_logits([0, 0, 0, 1, 2, 3, 0, 1])  # expert 0 chosen 4 times, capacity ceil(8/4) = 2
    r = top1_routing(logits, 1.0, 0, True, False, None, None)
    assert r.capacity == 2 and r.exp_counts.tolist() == [4, 2, 1, 1]  # counts before drops
    kept = r.dispatch.any(dim=2)  # [S, E]
    assert kept[:, 0].sum() == 2 and kept[:, 1].sum() == 2  # expert 0 keeps 2 of its 4
    gates = torch.softmax(logits, dim=1)
    s = int(kept[:, 0].nonzero()[0])
    assert r.combine[s, 0].sum() == pytest.approx(float(gates[s, 0]))  # top-1 weight: the probability itself
    me, ce = gates.mean(0), torch.tensor([4, 2, 1, 1]) / 8
    assert float(r.l_aux) == pytest.approx(float((me * ce).sum() * 4), rel=1e-6)


def test_top1_without_drops_takes_the_largest_count():
    r = top1_routing(one_hot_logits([0, 0, 0, 1]), 1.0, 0, False, False, None, None)
    assert r.capacity == 3 and r.dispatch.any(dim=2).sum() == 4  # nothing dropped


def test_top2_renormalizes_the_two_kept_gates_and_queues_second_choices_after_first():
    logits = one_hot_logits([0, 1, 2, 3], second=[1, 0, 3, 2])
    r = top2_routing(logits, 1.0, 0, True, False, None)
    assert r.capacity == 2  # ceil(4 / 4 * 1.0 * 2)
    assert torch.allclose(r.combine.sum(dim=(1, 2)), torch.ones(4))  # each token's two weights sum to 1
    slot_of_second = r.combine[0, 1].nonzero()  # token 0's second choice (expert 1) queues after token 1's first
    assert int(slot_of_second) == 1


def test_top2_drops_a_second_choice_first():
    logits = one_hot_logits([0, 0, 1, 2], second=[1, 1, 0, 3])  # expert 0: two firsts, one second; capacity 2
    r = top2_routing(logits, 1.0, 0, True, False, None)
    assert r.combine[2, 0].sum() == 0  # token 2's second choice (expert 0) is dropped: its firsts fill it
    assert r.combine[2].sum() == pytest.approx(1.0)  # the kept one gets the whole weight


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="top 1 or top 2"):
        TopKGate(4, 4, k=3)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        TopKGate(4, 4, noisy_gate_policy="Gaussian")
    with pytest.raises(ValueError, match="k=1 only"):
        TopKGate(4, 4, k=2, noisy_gate_policy="Jitter")
    with pytest.raises(ValueError, match="divisible"):
        MoE(4, torch.nn.Linear(4, 4), num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="fewer than min_capacity"):
        MoE(4, torch.nn.Linear(4, 4), num_experts=2, min_capacity=8)(torch.randn(3, 4))


def test_an_expert_without_tokens_gets_no_gradient():
    torch.manual_seed(0)
    layer = MoE(4, torch.nn.Linear(4, 4), num_experts=4, use_rts=False, min_capacity=0)
    with torch.no_grad():
        layer.moe.gate.wg.weight.zero_()  # equal logits: every token's first choice is expert 0
    out, l_aux, counts = layer(torch.randn(6, 4))
    (out.sum() + l_aux).backward()
    assert counts.tolist() == [6, 0, 0, 0]
    assert layer.moe.experts[0].weight.grad is not None
    assert all(e.weight.grad is None for e in list(layer.moe.experts)[1:])  # not called: skipped as torch skips
    assert not math.isnan(float(l_aux.detach()))
