"""Transformers' packed experts under expert parallelism, in one process (moe/packed.py, docs/moe_ep.md): which
modules are found in the four MoE models, what cannot be split and the error saying so, the config section's
refusals, and the dispatch around the module's own forward equal to that forward (output and every gradient, for
each of transformers' experts kernels)."""

import copy

import pytest
import torch

import zerodp
from zerodp.config.expert_parallel import _AUTOEP_LAYER_KEYS
from zerodp.moe.packed import PackedExperts, find_packed_experts

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=16)
MODELS = {
    "MixtralForCausalLM": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
    "Qwen3MoeForCausalLM": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, intermediate_size=24, moe_intermediate_size=24, head_dim=8, num_experts=4, num_experts_per_tok=2)),
    "OlmoeForCausalLM": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **SMALL, intermediate_size=24, num_experts=4, num_experts_per_tok=2)),
    "Qwen2MoeForCausalLM": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **SMALL, intermediate_size=24, moe_intermediate_size=24, shared_expert_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2)),
}


def make(name):
    torch.manual_seed(0)
    return MODELS[name]()


@pytest.mark.parametrize("name", list(MODELS))
def test_every_decoder_layers_experts_are_found(name):
    found = find_packed_experts(make(name), 2)
    assert [p.name for p in found] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(p.num_experts == 4 and p.num_local_experts == 2 for p in found)
    assert [n for n, _ in found[0].module.named_parameters()] == ["gate_up_proj", "down_proj"]
    assert find_packed_experts(make(name), None) == []  # the section not enabled: nothing is touched


class ListMoE(torch.nn.Module):
    """Experts in an nn.ModuleList: nothing packed to split."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))
        self.num_experts = 4


def test_a_model_without_packed_experts_is_refused_with_the_fix():
    with pytest.raises(zerodp.ConfigError) as err:
        find_packed_experts(ListMoE(), 2)
    message = str(err.value)
    assert "ListMoE has no packed experts" in message
    assert "zerodp.moe.MoE(..., ep_size=2)" in message and "remove the expert_parallel section" in message


@pytest.mark.parametrize("change,why", [
    (lambda e: e.register_parameter("scale", torch.nn.Parameter(torch.ones(3))), r"its parameters \[.scale.\] do not lead"),
    (lambda e: e.add_module("norm", torch.nn.LayerNorm(16)), r"it has parameters in submodules \(\[.norm.weight."),
    (lambda e: setattr(e, "forward", lambda x, routing: x), r"its forward takes \[.x., .routing.\]"),
])
def test_experts_that_break_the_contract_are_refused_by_name(change, why):
    model = make("MixtralForCausalLM")
    change(model.model.layers[1].mlp.experts)
    with pytest.raises(zerodp.ConfigError, match=r"cannot split model.layers.1.mlp.experts \(MixtralExperts\) of "
                                                 r"MixtralForCausalLM: " + why):
        find_packed_experts(model, 2)


def test_a_size_that_does_not_divide_the_experts_is_refused():
    with pytest.raises(zerodp.ConfigError, match="autoep_size=3 does not divide the 4 experts of model.layers.0"):
        find_packed_experts(make("OlmoeForCausalLM"), 3)


def test_the_section_refuses_what_it_does_not_do():
    base = {"train_micro_batch_size_per_gpu": 1}
    config = zerodp.load_config({**base, "expert_parallel": {"enabled": True, "autoep_size": 2}})
    assert config.expert_parallel.enabled and config.expert_parallel.autoep_size == 2
    with pytest.raises(zerodp.ConfigError, match="autoep_size=2 without enabled: true splits nothing"):
        zerodp.load_config({**base, "expert_parallel": {"autoep_size": 2}})
    for key in _AUTOEP_LAYER_KEYS:  # DeepSpeed 0.19.8's settings of its own replacement layer, every one
        with pytest.raises(zerodp.ConfigError, match=f"expert_parallel.{key} configures DeepSpeed's AutoEP"):
            zerodp.load_config({**base, "expert_parallel": {"enabled": True, key: None}})


def test_an_engine_with_autoep_size_larger_than_the_world_is_refused():
    model = make("MixtralForCausalLM")
    with pytest.raises(zerodp.ConfigError, match="expert-parallel size 2 .* does not divide the 1 data-parallel"):
        zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          {"train_micro_batch_size_per_gpu": 1, "expert_parallel": {"enabled": True, "autoep_size": 2}})


@pytest.mark.parametrize("kernel", ["eager", "grouped_mm", "batched_mm"])
def test_dispatch_around_the_modules_forward_equals_that_forward(kernel):
    """ep_size 1 in one process: the all-to-alls are identities, so what is left is the slotting, the per-row
    forward with local ids and the per-token sum, which must give the module's own output and gradients."""
    torch.manual_seed(0)
    model = make("MixtralForCausalLM")
    model.config._experts_implementation = kernel
    plain = model.model.layers[0].mlp.experts
    split = copy.deepcopy(plain)
    packed = PackedExperts(split, "experts", 1)
    packed.bind(None)
    hidden = torch.randn(7, 16)
    index = torch.tensor([[0, 2], [2, 0], [3, 1], [1, 3], [0, 1], [2, 3], [0, 2]])  # expert 0 thrice, with others
    weights = torch.rand(7, 2)
    outs, grads = [], []
    for module in (plain, split):
        h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(h, index, w)
        out.pow(2).sum().backward()
        outs.append(out)
        grads.append([h.grad, w.grad, *(p.grad for p in module.parameters())])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-7)  # fp32: summation order only
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    packed.unbind()
    with pytest.raises(RuntimeError, match="holds 4 of 4 experts .* its engine is closed"):
        split(hidden, index, weights)


def test_autoep_size_one_splits_nothing_and_still_checks_the_model():
    """DeepSpeed's meaning: enabled with autoep_size 1 is expert parallelism over one rank, every expert kept; the
    model trains as without the section (no hooks left on it), and one with nothing to split is still refused."""
    config = {"train_micro_batch_size_per_gpu": 2, "expert_parallel": {"enabled": True, "autoep_size": 1}}
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    losses = []
    for section in (True, False):
        model = make("MixtralForCausalLM")
        engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   config if section else {"train_micro_batch_size_per_gpu": 2})
        try:
            for _ in range(2):
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4
        finally:
            engine.close()
        model(input_ids=ids)  # nothing split, nothing hooked: the model runs on after its engine
    assert losses[:2] == losses[2:]
    plain = ListMoE()
    with pytest.raises(zerodp.ConfigError, match="ListMoE has no packed experts"):
        zerodp.initialize(plain, torch.optim.SGD(plain.parameters(), lr=0.1), config)
