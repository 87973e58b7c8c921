"""Transformers' own MoE models (packed 3-D experts) with expert parallelism: DeepSpeed's AutoEP config section `expert_parallel:
{enabled: true, autoep_size: 2}` on 4 gloo ranks (EP 2 x DP 2) splits every experts module on the expert dimension (each rank keeps 2 of the 4
experts), tokens travel to their expert's rank by all-to-all, and training equals the single-process model holding
every expert (losses and parameters over 8 steps, each rank its own tokens, routed differently per rank);
bf16 equals plain-PyTorch mixed precision (tests/oracle.py); a model zerodp cannot split is refused by name
(docs/moe_ep.md). One spawn of 4 ranks runs every case."""

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp
from tests.dist import harness
from tests.dist.common import train_own_tokens
from tests.oracle import assert_matches_reference, assert_trained, mixed_precision_reference, train_reference

transformers = pytest.importorskip("transformers")

SEQ, VOCAB, MICRO_BS, STEPS, LR, CLIP = 8, 64, 2, 8, 0.2, 1.0
WORLD, EP, EXPERTS = 4, 2, 4
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=SEQ + 4)
MODELS = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, intermediate_size=48, num_local_experts=EXPERTS, num_experts_per_tok=2)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, intermediate_size=48, moe_intermediate_size=48, head_dim=8, num_experts=EXPERTS,
        num_experts_per_tok=2)),
    "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **SMALL, intermediate_size=48, num_experts=EXPERTS, num_experts_per_tok=2)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **SMALL, intermediate_size=48, moe_intermediate_size=48, shared_expert_intermediate_size=48,
        num_experts=EXPERTS, num_experts_per_tok=2)),
}
# (model, stage): every model, every stage; with the bf16 and recompute cases, 9 runs in one spawn
CASES = [("mixtral", 0), ("mixtral", 3), ("qwen3_moe", 1), ("qwen3_moe", 3), ("olmoe", 2), ("qwen2_moe", 3)]
BF16_STAGES = (2, 3)


def make(name: str, gate_scale: float = 4.0):
    """The single-process model; its routers sharpened so that routing depends strongly on the tokens."""
    torch.manual_seed(0)
    model = MODELS[name]()
    with torch.no_grad():
        for module in model.modules():
            if module.__class__.__name__.endswith("TopKRouter"):
                module.weight.mul_(gate_scale)
    return model


def batch(step: int, rows: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(300 + step))


def sgd(params):
    # SGD, not Adam: a router row of an expert no top-k choice reached has a true gradient of zero whose float
    # noise Adam would turn into an lr-sized step (STYLE.md, Tests)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def config(stage: int, bf16: bool = False, ep: int = EP) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BS, "gradient_clipping": CLIP, "expert_parallel": {"enabled": True, "autoep_size": ep},
           "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else
                                                    {"reduce_bucket_size": 2000})}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def train_case(name: str, stage: int, bf16: bool = False, recompute: bool = False):
    """This rank's global-mean losses, its parameters (experts: its own E/EP), how many of its tokens' choices
    went to each global expert at the first step (seen by a hook registered before zerodp's, so before the
    dispatch), and (fp32) engine.full_state_dict(). `recompute`: HF's gradient checkpointing, so each layer's
    forward, all-to-alls included, runs again in backward."""
    model = make(name)
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")][0]
    chosen = []  # per forward of the first layer's experts, its tokens' choices per global expert
    experts.register_forward_pre_hook(lambda module, args: chosen.append(
        torch.bincount(args[1].reshape(-1), minlength=EXPERTS).tolist()))
    engine = zerodp.initialize(model, sgd(model.parameters()), config(stage, bf16))
    try:
        def check(step: int) -> None:
            assert len(chosen) == (2 if recompute else 1) * (step + 1), "with recompute the experts run twice a step"

        losses = train_own_tokens(engine, STEPS, batch, MICRO_BS, check)
        with zerodp.gathered_parameters(model.parameters()):
            params = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
        full = None if bf16 else engine.full_state_dict(rank0_only=False)  # every expert, packed back together
        return losses, params, chosen[0], full
    finally:
        engine.close()


def refusals_case() -> list[str]:
    """A model zerodp cannot split is refused at initialize, naming its class and the fix; a closed engine's split
    experts say so instead of computing with the wrong experts."""
    messages = []
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(zerodp.ConfigError, match="Sequential has no packed experts") as err:
        zerodp.initialize(plain, sgd(plain.parameters()), config(2))
    messages.append(str(err.value))
    model = make("mixtral")
    experts = model.model.layers[0].mlp.experts
    experts.register_parameter("scale", torch.nn.Parameter(torch.ones(3)))  # a parameter not per expert
    with pytest.raises(zerodp.ConfigError, match=r"cannot split model.layers.0.mlp.experts \(MixtralExperts\) of "
                                                 r"MixtralForCausalLM: its parameters \['scale'\]"):
        zerodp.initialize(model, sgd(model.parameters()), config(2))
    model = make("mixtral")
    engine = zerodp.initialize(model, sgd(model.parameters()), config(1))
    engine.close()
    with pytest.raises(RuntimeError, match="holds 2 of 4 experts .* its engine is closed"):
        model(input_ids=batch(0, 1))
    return messages


def resume_case():
    """Mixtral trained half its steps at EP 2 x DP 2, stage 3, saved (each rank's piece of every packed tensor), then
    loaded into a model with other weights at EP 4 x DP 1, stage 1 (one expert per rank), and trained on: the run
    must be the uninterrupted single-process one. Returns the losses and the full state dict at the end."""
    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    model = make("mixtral")
    engine = zerodp.initialize(model, sgd(model.parameters()), config(3))
    losses = train_own_tokens(engine, range(STEPS // 2), batch, MICRO_BS)
    engine.save_checkpoint(folder[0])
    engine.close()
    model = make("mixtral")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # other weights: the load must set every value
    engine = zerodp.initialize(model, sgd(model.parameters()), config(1, ep=4))
    engine.load_checkpoint(folder[0])
    losses += train_own_tokens(engine, range(STEPS // 2, STEPS), batch, MICRO_BS)
    full = engine.full_state_dict(rank0_only=False)
    engine.close()
    return losses, full


def run_all():
    results = {case: train_case(*case) for case in CASES}
    results["resume"] = resume_case()
    results.update({("mixtral", stage, "bf16"): train_case("mixtral", stage, True) for stage in BF16_STAGES})
    results[("qwen3_moe", 2, "recompute")] = train_case("qwen3_moe", 2, recompute=True)
    results["refusals"] = refusals_case()
    return results


def reference(name: str):
    def step_loss(model, step):
        ids = batch(step, MICRO_BS * WORLD)
        return model(input_ids=ids, labels=ids).loss

    model = make(name)
    return train_reference(model, sgd(model.parameters()), STEPS, step_loss, clip=CLIP)


def bf16_reference():
    def loss_fn(logits, ids, model):
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    model = make("mixtral").to(torch.bfloat16)
    batches = ((ids, ids) for ids in (batch(step, MICRO_BS * WORLD) for step in range(STEPS)))
    return mixed_precision_reference(_Logits(model), lambda m: sgd(m.parameters()), batches, loss_fn, CLIP)


class _Logits(torch.nn.Module):
    """The HF model's logits as the module's output (mixed_precision_reference hands the output to loss_fn)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def own_experts(ref: dict, params: dict, rank: int) -> dict:
    """The reference's state with each packed tensor cut to this rank's experts (consecutive EP groups)."""
    local = EXPERTS // EP
    first = (rank % EP) * local
    out = {}
    for key, value in ref.items():
        if ".experts." in key:
            assert params[key].shape[0] == local, f"rank {rank}: {key} must hold {local} experts, has {params[key].shape}"
            value = value[first:first + local]
        out[key] = value
    return out


@pytest.fixture(scope="module")
def results():
    """Every case of this module, run by one spawn of 4 ranks (spawning is the slow part)."""
    return harness.run(WORLD, run_all, timeout=300)


@pytest.mark.parametrize("name,stage,variant", [(*case, "") for case in CASES] + [("qwen3_moe", 2, "recompute")])
def test_hf_packed_experts_with_expert_parallelism_equal_one_process(results, name, stage, variant):
    ref = reference(name)
    assert_trained(ref.params, make(name).state_dict())
    firsts = []
    for rank, result in enumerate(results):
        losses, params, chosen, full = result[(name, stage, variant) if variant else (name, stage)]
        firsts.append(chosen)
        assert_matches_reference(rank, losses, params, ref.losses, own_experts(ref.params, params, rank),
                                 f"{name} stage {stage}")
        # engine.full_state_dict: the single-process model's, each packed tensor whole again
        assert set(full) == set(ref.params), sorted(set(full) ^ set(ref.params))
        assert_matches_reference(rank, losses, full, ref.losses, ref.params, f"{name} stage {stage} full_state_dict")
    # each rank's tokens reach the experts of both ranks of its pair (the all-to-all carries them), and the ranks
    # route differently
    local = EXPERTS // EP
    assert all(sum(c[:local]) and sum(c[local:]) for c in firsts), f"{name}: {firsts}"
    assert len({tuple(c) for c in firsts}) == WORLD, f"{name}: ranks routed alike: {firsts}"


# bf16 tolerance. tests/dist/test_precision.py justifies 2 bf16 ulps relative (8e-3) for data parallelism: the
# reference rounds each weight gradient to bf16 once over the global batch, zerodp rounds each rank's and sums bf16
# values. Expert parallelism adds one rounding: one process sums a token's k expert outputs in fp32 and rounds once
# (transformers' default grouped_mm kernel), while each output comes back over the all-to-all already rounded to
# bf16 and the k are summed then (and the same for their gradients in backward). The losses stay within 2 ulps;
# parameters get 3 (1.2e-2): seen at most 1.04 x 2 ulps (one element of the embedding, stage 3), 0.9 x 2 ulps with
# the eager kernel, which rounds like expert parallelism, and 0.61 x 2 ulps without expert parallelism.
BF16_LOSS_RTOL, BF16_PARAM_RTOL = 8e-3, 1.2e-2


@pytest.mark.parametrize("stage", BF16_STAGES)
def test_hf_packed_experts_bf16_with_expert_parallelism_equal_mixed_precision(results, stage):
    ref_losses, ref_params = bf16_reference()
    ref_params = {k.removeprefix("model."): v for k, v in ref_params.items()}  # _Logits wraps the model
    for rank, result in enumerate(results):
        losses, params, _, _ = result[("mixtral", stage, "bf16")]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=BF16_LOSS_RTOL, atol=0)
        for key, ref in own_experts(ref_params, params, rank).items():
            close = (params[key] - ref).abs() <= BF16_PARAM_RTOL * (ref.abs() + ref.abs().max())
            assert bool(close.all()), f"bf16 stage {stage} rank {rank} {key}: {int((~close).sum())} elements differ"


def test_a_model_zerodp_cannot_split_is_refused(results):
    message = results[0]["refusals"][0]
    assert "zerodp.moe.MoE(..., ep_size=2)" in message and "remove the expert_parallel section" in message


def test_packed_experts_checkpoint_loads_at_another_expert_parallel_size(results):
    """Saved at EP 2 x DP 2 (stage 3), loaded at EP 4 x DP 1 (stage 1): the resumed run equals the uninterrupted
    single-process one (moe/checkpoint.py joins each packed tensor's pieces and cuts this rank's experts out)."""
    ref = reference("mixtral")
    for rank, result in enumerate(results):
        losses, full = result["resume"]
        assert set(full) == set(ref.params), sorted(set(full) ^ set(ref.params))
        assert_matches_reference(rank, losses, full, ref.losses, ref.params, "mixtral saved at EP 2, resumed at EP 4")
