"""The `moe` section: expert parallelism for models whose experts zerodp splits itself (docs/moe_ep.md).

A `zerodp.moe.MoE` or `deepspeed.moe.layer.MoE` layer carries its own `ep_size`; this section is for the
models that carry none: Hugging Face transformers' packed experts (one module holding every expert's weights
as 3-D tensors [num_experts, ...]), split by zerodp on the expert dimension at `zerodp.initialize`.
"""

from __future__ import annotations

from pydantic import Field

from .strict import StrictModel


class MoEConfig(StrictModel):
    """`moe`: how zerodp splits a model's packed experts over ranks."""

    expert_parallel_size: int = Field(1, ge=1, description="Split every packed-experts module (transformers' "
                                      "Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE experts: 3-D tensors [num_experts, "
                                      "...]) over this many consecutive ranks, each keeping num_experts / this of "
                                      "them; tokens reach their expert's rank by all-to-all (docs/moe_ep.md). 1: "
                                      "every rank holds every expert. A model with no packed experts zerodp can "
                                      "split is an error naming its class.")
