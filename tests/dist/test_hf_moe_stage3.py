"""Transformers' own MoE classes at ZeRO stage 3 with the DEFAULT config (no unit settings): the units are the
classes in `_no_split_modules` (MixtralDecoderLayer, Qwen3MoeDecoderLayer), so ranks whose tokens route to
different experts still gather the same units (docs/moe.md), and training equals the single-process model
(2 gloo ranks, each rank its own tokens). Each block holds over 100,000 parameters (the default
stage3_unit_min_params), so it is a unit of its own; a smaller one would stay in the unit around it."""

import pytest
import torch

import zerodp
from tests.dist.common import train_own_tokens
from tests.oracle import assert_matches_reference, train_reference

transformers = pytest.importorskip("transformers")

SEQ, VOCAB, MICRO_BS, STEPS, LR = 8, 64, 2, 4, 0.2
MODELS = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ + 4)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=SEQ + 4)),
}


def make(name: str):
    torch.manual_seed(0)
    return MODELS[name]()


def batch(step: int, rows: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(200 + step))


def sgd(params):
    # SGD, not Adam: an expert row whose gradient is only summation noise stays noise-sized (STYLE.md, Tests)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def zerodp_case(name: str):
    model = make(name)
    engine = zerodp.initialize(model, sgd(model.parameters()), {"train_micro_batch_size_per_gpu": MICRO_BS,
                                                                "zero_optimization": {"stage": 3}})
    units = sorted({type(m.module).__name__ for m in engine.sharding.module_units})
    losses = train_own_tokens(engine, STEPS, batch, MICRO_BS)
    with zerodp.gathered_parameters(model.parameters()):
        params = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    engine.close()
    return losses, params, units


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_moe_at_the_default_stage3_config_equals_one_process(dist_run, name):
    world = 2
    results = dist_run(world, zerodp_case, name)

    def step_loss(model, step):
        ids = batch(step, MICRO_BS * world)
        return model(input_ids=ids, labels=ids).loss

    model = make(name)
    ref = train_reference(model, sgd(model.parameters()), STEPS, step_loss)
    init = make(name).state_dict()
    assert max((ref.params[k] - init[k].float()).abs().max().item() for k in init) > 1e-3, "the reference must train"
    block = model.model.layers[0].__class__.__name__
    for rank, (losses, params, units) in enumerate(results):
        assert block in units, f"{name}: the decoder layers ({block}) must be units, got {units}"
        assert not any("Expert" in u or u == "Linear" for u in units), f"{name}: no unit below a block: {units}"
        assert_matches_reference(rank, losses, params, ref.losses, ref.params, name)
