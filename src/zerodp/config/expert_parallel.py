"""DeepSpeed's `expert_parallel` section (its AutoEP): expert parallelism for models whose MoE layers carry no
ep_size of their own, split by zerodp at `zerodp.initialize` (docs/moe_ep.md).

A `zerodp.moe.MoE` or `deepspeed.moe.layer.MoE` layer carries its own `ep_size` and needs none of this. This
section is for Hugging Face transformers' packed experts (one module holding every expert's weights as 3-D
tensors [num_experts, ...]): `enabled` and `autoep_size` have DeepSpeed's meaning (expert-parallel groups of
autoep_size consecutive ranks, DeepSpeed's "E + D" layout). Where zerodp departs: DeepSpeed replaces each MoE
block by its own layer (per-model presets); zerodp keeps the model's own router and experts forward and moves
the tokens around the experts module, so the model computes what it computes in one process. DeepSpeed's
settings for its replacement layer (presets, kernels, communication backends) are refused by name.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from .strict import StrictModel

# DeepSpeed 0.19.8's other AutoEP keys (deepspeed/module_inject/auto_ep_config.py): its replacement layer's
_AUTOEP_LAYER_KEYS = (
    "expert_tensor_parallel_size", "validate_folding_routing", "async_split_plan", "preset_model",
    "moe_layer_pattern", "expert_pattern", "router_pattern", "use_grouped_mm", "disable_triton_grouped_mm",
    "route_norm", "route_scale", "score_apply", "combine_impl", "row_weighting_impl", "gate_up_impl", "comm_backend",
    "comm_num_sm", "comm_qp_margin", "comm_max_tokens_per_rank", "num_expert_groups", "num_limited_groups",
    "score_func", "top_k", "load_balance_coeff", "routed_scaling_factor", "expert_w1", "expert_w2", "expert_w3",
    "num_experts_attr", "top_k_attr", "has_shared_experts", "shared_experts_pattern", "shared_experts_gate_pattern",
    "expert_activation")


class ExpertParallelConfig(StrictModel):
    """`expert_parallel`: split a model's packed experts over ranks (DeepSpeed's AutoEP keys)."""

    enabled: bool = Field(False, description="Split every packed-experts module (transformers' Mixtral, Qwen2-MoE, "
                          "Qwen3-MoE, OLMoE experts: 3-D tensors [num_experts, ...]) over autoep_size consecutive "
                          "ranks on the expert dimension; tokens reach their expert's rank by all-to-all "
                          "(docs/moe_ep.md). A model with no packed experts zerodp can split is an error naming "
                          "its class.")
    autoep_size: int = Field(1, ge=1, description="Ranks per expert-parallel group; each keeps num_experts / "
                             "autoep_size experts of every packed-experts module. Divides the world size and "
                             "num_experts.")

    @model_validator(mode="before")
    @classmethod
    def _refuse_layer_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if key in _AUTOEP_LAYER_KEYS:
                    raise ValueError(f"expert_parallel.{key} configures DeepSpeed's AutoEP replacement layer; zerodp "
                                     f"keeps the model's own MoE forward and splits its packed experts, so it does not "
                                     f"implement it: remove it (docs/moe_ep.md)")
        return data

    @model_validator(mode="after")
    def _size_needs_enabled(self) -> "ExpertParallelConfig":
        if self.autoep_size > 1 and not self.enabled:
            raise ValueError(f"expert_parallel.autoep_size={self.autoep_size} without enabled: true splits nothing; "
                             f"set expert_parallel.enabled to true, or remove autoep_size")
        return self
