"""Stage 3 in one process (no process group): unit planning, the partitioned-parameter contract,
gathered_parameters, and the execution-order record that prefetch uses."""

from __future__ import annotations

import importlib
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerodp
from zerodp.config import ConfigError
from zerodp.tools.models.gpt import GPT, GPTConfig, lm_loss
from zerodp.shard.stage3.prefetch import ExecutionOrder, Pass
from zerodp.shard.stage3.flat_unit import ShardState
from zerodp.shard.stage3.wrap import choose_unit_modules, plan_units


def tiny_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=8), seed=0)


def engine_for(model: nn.Module, **zero) -> zerodp.ZeroEngine:
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}
    return zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)


def owner_names(model, class_names=(), min_params=10**9) -> dict[str, list[str]]:
    plans = plan_units(model, choose_unit_modules(model, list(class_names), min_params))
    return {plan.name or "<root>": plan.names for plan in plans}


# -- planning ---------------------------------------------------------------------------------------


def test_tied_weight_goes_to_the_unit_around_every_user():
    plans = owner_names(tiny_gpt(), ["Block", "Embedding"])
    # wte.weight is also lm_head.weight: its users wte and lm_head meet at the root
    assert "wte.weight" in plans["<root>"] and plans["wte"] == []
    assert plans["wpe"] == ["wpe.weight"]
    assert plans["blocks.0"][0] == "blocks.0.ln_1.weight" and len(plans["blocks.0"]) == 10
    every = [n for names in plans.values() for n in names]
    assert sorted(every) == sorted(n for n, _ in tiny_gpt().named_parameters())  # each parameter once


def test_auto_wrap_claims_modules_above_the_threshold():
    model = nn.Sequential(nn.Linear(10, 10), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)), nn.Linear(2, 2))
    # Linear(10,10) has 110 elements; the inner Sequential 24 in total; Linear(2,2) 6
    plans = owner_names(model, min_params=20)
    assert plans == {"<root>": ["2.weight", "2.bias"], "0": ["0.weight", "0.bias"],
                     "1": ["1.0.weight", "1.0.bias", "1.1.weight", "1.1.bias"]}


def test_unknown_unit_class_is_a_config_error():
    with pytest.raises(ConfigError, match=r"stage3_unit_modules names \['Blok'\].*Block"):
        choose_unit_modules(tiny_gpt(), ["Blok"], 0)


# -- the partitioned-parameter contract (world size 1: one shard, same mechanics) -----------------


def test_partitioned_parameter_keeps_metadata_and_names_the_fix():
    model = tiny_gpt()
    count = model.num_parameters()
    engine = engine_for(model, stage3_unit_modules=["Block"])
    w = model.blocks[0].attn.qkv.weight
    assert type(w).__name__ == "PartitionedParameter" and isinstance(w, nn.Parameter)
    assert w.shape == (24, 8) and w.numel() == 192 and w.requires_grad and w.grad is None
    assert model.num_parameters() == count
    assert "gathered_parameters" in repr(w)
    with pytest.raises(zerodp.PartitionedParameterError, match=r"'blocks\.0\.attn\.qkv\.weight'.*"
                                                               r"zerodp\.gathered_parameters"):
        w.sum()
    with pytest.raises(zerodp.PartitionedParameterError):
        model.state_dict()
    with zerodp.gathered_parameters([w]):
        assert type(w) is nn.Parameter and w.abs().sum() > 0
    assert engine.sharding.live_numel == 0


def test_gathered_parameters_modifier_writes_the_shard():
    model = tiny_gpt()
    engine = engine_for(model, stage3_unit_modules=["Block"])
    w = model.blocks[1].mlp.fc.weight
    with zerodp.gathered_parameters(w, modifier_rank=0):
        with torch.no_grad():
            w.fill_(0.5)
    with zerodp.gathered_parameters(w):  # read-only: this write is dropped with the storage
        with torch.no_grad():
            w.fill_(9.0)
    with zerodp.gathered_parameters(w):
        assert torch.all(w == 0.5)
    unit = engine.sharding.module_units[2].flats[0]
    assert unit.state is ShardState.SHARDED


def test_plain_loss_backward_is_refused_with_the_fix():
    model = tiny_gpt()
    engine = engine_for(model, stage3_unit_modules=["Block"])
    ids = torch.randint(0, 17, (2, 5))
    with pytest.raises(RuntimeError, match=r"engine\.backward\(loss\)"):
        lm_loss(engine(ids), ids).backward()


class ParentReadsChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)

    def forward(self, ids):
        return F.linear(torch.tanh(self.mix(self.embed(ids))), self.embed.weight)


def test_a_parent_reading_a_child_units_weight_borrows_it():
    model = ParentReadsChild()
    engine = engine_for(model, stage3_unit_modules=["Embedding"])
    root = engine.sharding.root
    assert len(root.gather_set) == 1  # mix only
    ids = torch.randint(0, 11, (3, 4))
    engine.backward(F.cross_entropy(engine(ids).flatten(0, 1), ids.flatten()))
    engine.step()
    assert len(root.gather_set) == 2  # the embedding's unit is gathered with the root from now on
    assert engine.sharding.live_numel == 0
    with pytest.raises(zerodp.PartitionedParameterError):  # outside any forward: still an error
        model.embed.weight @ torch.ones(6)


# -- the execution order ----------------------------------------------------------------------------


def test_execution_order_keeps_first_use_of_the_last_pass():
    order = ExecutionOrder()
    a, b, c = object(), object(), object()
    order.start(Pass.FORWARD)
    for u in (a, b, a, c):
        order.record(Pass.FORWARD, u)
    assert order.following(Pass.FORWARD, a) == []  # nothing finished yet
    order.finish(Pass.FORWARD)
    assert order.last(Pass.FORWARD) == [a, b, c]
    assert order.following(Pass.FORWARD, b) == [c]
    order.start(Pass.FORWARD)
    order.finish(Pass.FORWARD)  # an empty pass (no unit ran) keeps the previous record
    assert order.last(Pass.FORWARD) == [a, b, c]


# -- init_context -----------------------------------------------------------------------------------


class InitTouchesTwo(nn.Module):
    """An init routine that reads one parameter into another (two partitioned parameters in one op)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight * 2)


def test_init_context_builds_the_same_model_one_parameter_at_a_time(monkeypatch):
    init_module = importlib.import_module("zerodp.shard.stage3.init_context")  # the package exports a function of that name

    whole_at_once = []
    original = init_module._InitContext.make_whole

    def spy(ctx, shards):
        original(ctx, shards)
        whole_at_once.append(len(ctx._whole))

    monkeypatch.setattr(init_module._InitContext, "make_whole", spy)
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 7}}
    torch.manual_seed(4)
    plain = InitTouchesTwo()
    torch.manual_seed(4)
    with zerodp.init_context(cfg):
        model = InitTouchesTwo()
    assert max(whole_at_once) <= 2  # the two parameters of the copy; otherwise one at a time
    assert type(model.a.weight).__name__ == "PartitionedParameter" and model.a.weight.shape == (6, 6)
    assert type(model.a.bias) is nn.Parameter  # 6 elements < 7: stays whole
    with pytest.raises(zerodp.PartitionedParameterError, match="init_context"):
        model.a.weight.sum()
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    with zerodp.gathered_parameters(model.parameters()):
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(p, q), name
    assert engine.sharding.live_numel == 0


def test_init_context_needs_stage_3():
    with pytest.raises(ConfigError, match="stage 3"):
        with zerodp.init_context({"zero_optimization": {"stage": 2}}):
            pass
