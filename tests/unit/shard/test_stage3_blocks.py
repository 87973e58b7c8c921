"""The default stage-3 unit policy keeps the model's repeated blocks whole (stage3/blocks.py, wrap.py), and the
user's own choices (stage3_unit_modules, set_z3_leaf_modules, an explicit stage3_unit_min_params) still decide
when set. One process, no process group."""

from __future__ import annotations

from torch import nn

from tests.dist.common import ParityNet
from tests.dist.moe_common import ClassicMoE, Expert
from zerodp.config import load_config
from zerodp.tools.models.gpt import GPT, GPTConfig
from zerodp.shard.stage3.blocks import repeated_block_classes
from zerodp.shard.stage3.wrap import units_for


def unit_names(model: nn.Module, **zero) -> list[str]:
    cfg = load_config({"zero_optimization": {"stage": 3, **zero}})
    return [name or "<root>" for name, _ in units_for(model, cfg.zero_optimization)]


def test_classic_moe_default_units_are_its_blocks_never_an_expert():
    model = ClassicMoE()
    assert repeated_block_classes(model) == {"Block"}  # the blocks list holds the experts lists: it is the largest
    assert unit_names(model) == ["<root>", "blocks.0", "blocks.1"]


def test_an_explicit_threshold_alone_decides_as_before():
    names = unit_names(ClassicMoE(), stage3_unit_min_params=100_000)
    assert "blocks.0.moe.experts.4.w1" in names and "blocks.0" not in names  # each 131,072-element Linear


def test_stage3_unit_modules_and_leaf_modules_decide_when_set():
    assert unit_names(ClassicMoE(), stage3_unit_modules=["Expert"])[1:3] == ["blocks.0.moe.experts.0",
                                                                             "blocks.0.moe.experts.1"]
    from zerodp.deepspeed.utils.z3_leaf import leaf_unit_modules, set_z3_leaf_modules
    model = ClassicMoE()
    set_z3_leaf_modules(model, [Expert])
    assert unit_names(model, stage3_unit_modules=leaf_unit_modules(model, []))[1] == "blocks.0.moe.experts.0"


def test_one_block_model_keeps_its_block_not_its_experts():
    assert unit_names(ClassicMoE(layers=1)) == ["<root>", "blocks.0"]


def test_small_blocks_stay_with_the_unit_around_them():
    model = ClassicMoE(width=32)  # a block of ~70k elements: under the default 100,000
    assert unit_names(model) == ["<root>"]
    assert "blocks.0.moe.experts.0.w1" in unit_names(model, stage3_unit_min_params=1000)  # set: by size alone


def test_hf_no_split_modules_wins_over_the_largest_list():
    model = ClassicMoE()
    model._no_split_modules = ["MoE"]  # as a transformers PreTrainedModel declares its layer classes
    assert repeated_block_classes(model) == {"MoE"}
    assert unit_names(model) == ["<root>", "blocks.0.moe", "blocks.1.moe"]
    model._no_split_modules = ["NotInThisModel"]  # absent classes are ignored
    assert repeated_block_classes(model) == {"Block"}


def test_models_without_a_block_list_are_wrapped_by_size_as_before():
    assert repeated_block_classes(ParityNet()) == set()
    gpt = GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=4, n_embd=192), seed=0)
    assert repeated_block_classes(gpt) == {"Block"}
    # a GPT block's MLP Linears (147,456 elements) are units when the threshold is set, not by default
    assert "blocks.0.mlp.fc" in " ".join(unit_names(gpt, stage3_unit_min_params=100_000))
    assert unit_names(gpt) == ["<root>", "blocks.0", "blocks.1"]
