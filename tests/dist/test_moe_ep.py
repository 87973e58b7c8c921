"""Expert parallelism with ZeRO (issue 42 part 3): EP 2 x DP 2 on 4 gloo ranks equals the single-process model
holding every expert (tests/dist/moe_ep_common.py), losses and parameters over 8 steps, with experts that get
no token on some steps (AdamW skips them, as torch does), token drops, top-1 and top-2, clipping; in bf16 equal
to plain-PyTorch mixed precision (tests/oracle.py's mixed_precision_reference)."""

import pytest
import torch

from tests.dist.common import assert_matches_reference
from tests.dist.moe_ep_common import mixed_reference_run, reference_run, refusals_run, resume_run, zerodp_run

STEPS, MICRO_BS, CLIP = 8, 6, 0.5
WORLD, EP = 4, 2
TOP1 = dict(k=1, use_rts=False, capacity_factor=1.0, min_capacity=0)  # capacity 1 slot: tokens are dropped
TOP2 = dict(k=2, top2_2nd_expert_sampling=False, min_capacity=0)


def config(stage: int, gas: int = 1, micro_bs: int = MICRO_BS) -> dict:
    return {"train_micro_batch_size_per_gpu": micro_bs, "gradient_accumulation_steps": gas,
            "gradient_clipping": CLIP,
            # stage 3: every dense parameter partitioned (none kept whole under the persistence threshold)
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 100,
                                  **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}}


def check(results, gas: int, options: dict, micro_bs: int = MICRO_BS, steps: int = STEPS, stage: int = 0) -> None:
    ref_losses, ref_params, unused, norms = reference_run(steps, WORLD, micro_bs, gas, CLIP, **options)
    assert any(unused), "the case must have steps where some expert gets no token"
    assert max(norms) > CLIP, "clipping must act on some step, or a wrong norm would go unseen"
    for rank, (losses, params, norm, full, partitioned) in enumerate(results):
        assert partitioned == (stage == 3), f"rank {rank}: dense units partitioned: {partitioned}"
        assert_matches_reference(rank, losses, params, ref_losses, {k: ref_params[k] for k in params})
        # engine.full_state_dict: the unsharded single-process model, every expert under its global name
        assert set(full) == set(ref_params), sorted(set(full) ^ set(ref_params))
        assert_matches_reference(rank, losses, full, ref_losses, ref_params, "full_state_dict")
    # ranks 0 and 1 hold the 8 experts between them (an expert-parallel group): every parameter was compared
    assert set(results[0][1]) | set(results[1][1]) == set(ref_params)
    # the last step's norm, over dense and expert gradients, is the single-process model's (fp32 summation order)
    for rank, (_, _, norm, _, _) in enumerate(results):
        assert norm == pytest.approx(norms[-1], rel=1e-5), f"rank {rank}: norm {norm} != {norms[-1]}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ep2_dp2_top1_matches_single_process(dist_run, stage):
    check(dist_run(WORLD, zerodp_run, config(stage), EP, STEPS, MICRO_BS, **TOP1), 1, TOP1, stage=stage)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_ep2_dp2_top2_accumulation_matches_single_process(dist_run, stage):
    # 3 tokens per rank and micro-step: with 8 experts and top-2, some expert still gets none on some step
    results = dist_run(WORLD, zerodp_run, config(stage, gas=2, micro_bs=3), EP, STEPS, 3, **TOP2)
    check(results, 2, TOP2, micro_bs=3, stage=stage)


def test_ep2_dp2_top2_two_slots_per_expert_matches_single_process(dist_run):
    """6 tokens per rank: each expert has 2 capacity slots. Before moe/all_to_all.py made its buffers contiguous,
    the combine's gradient (a permuted tensor from einsum's backward) came back with its slots scrambled, and every
    used expert's gradient was wrong whenever the capacity was 2 or more (the cases above have 1)."""
    check(dist_run(WORLD, zerodp_run, config(2), EP, STEPS, MICRO_BS, **TOP2), 1, TOP2, stage=2)


def test_experts_of_one_rank_without_any_token(dist_run):
    """At the first step no token reaches ep rank 1's experts (the gate's rows for them copy expert 0's): they run
    on nothing there, yet every rank's backward runs both all-to-alls ([Note: every rank's backward runs both
    all-to-alls] in zerodp/moe/layer.py); before that note, this case hung."""
    options = dict(TOP1, second_half_unreachable=True)
    ref_unused = reference_run(1, WORLD, MICRO_BS, 1, CLIP, **options)[2][0]
    assert set(ref_unused) >= {4, 5, 6, 7}, ref_unused
    check(dist_run(WORLD, zerodp_run, config(2), EP, 4, MICRO_BS, **options), 1, options, steps=4)


# 16-bit tolerances, tests/dist/test_precision.py's: 2 ulps relative on losses and parameters (bf16 8e-3, fp16
# 1e-3). The reference rounds each weight gradient to 16 bits once over the global batch, zerodp rounds each rank's
# and sums 16-bit values over ranks; the layer's own arithmetic (gate, experts, weighted sum) is the same code in
# 16 bits on both sides. SGD: an Adam step turns a near-zero gradient's rounding into an lr-sized move (STYLE.md,
# Tests). fp16 with a static loss scale of 256 on both sides (the reference scales and unscales as zerodp does).
RTOL = {"bf16": 8e-3, "fp16": 1e-3}
SECTION = {"bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True, "loss_scale": 256}}}
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("precision,stage", [("bf16", 2), ("bf16", 3), ("fp16", 2)])
def test_ep2_dp2_16_bits_matches_mixed_precision(dist_run, precision, stage):
    cfg = {**config(stage), **SECTION[precision]}
    results = dist_run(WORLD, zerodp_run, cfg, EP, STEPS, MICRO_BS, "sgd", **TOP2)
    scale = 256.0 if precision == "fp16" else 1.0
    ref_losses, ref_params = mixed_reference_run(DTYPE[precision], "sgd", STEPS, WORLD, MICRO_BS, CLIP, scale, **TOP2)
    ref_init = mixed_reference_run(DTYPE[precision], "sgd", 0, WORLD, MICRO_BS, CLIP, scale, **TOP2)[1]
    assert max((ref_params[k] - ref_init[k]).abs().max().item() for k in ref_init) > 1e-2, "the reference must train"
    rtol = RTOL[precision]
    for rank, (losses, params, _, _, _) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=0)
        for key, value in params.items():
            ref = ref_params[key]
            close = (value.float() - ref).abs() <= rtol * (ref.abs() + ref.abs().max())
            assert bool(close.all()), f"rank {rank} {key}: {int((~close).sum())} elements beyond 2 {precision} ulps"
    assert set(results[0][1]) | set(results[1][1]) == set(ref_params)  # every expert compared


def test_what_is_not_implemented_is_refused(dist_run):
    assert dist_run(WORLD, refusals_run, MICRO_BS) == [["offload_param"]] * WORLD


@pytest.mark.parametrize("saved,resumed", [((1, 2), (2, 4)), ((2, 2), (0, 1)), ((3, 2), (3, 4))],
                         ids=["ep2-to-ep4", "ep2-to-ep1", "stage3-ep2-to-ep4"])
def test_checkpoint_loads_at_another_ep_and_dp_size(dist_run, tmp_path, saved, resumed):
    """Saved at EP 2 x DP 2, resumed at EP 4 x DP 1 or EP 1 x DP 4, across stages: the 8 steps equal the
    single-process model's 8 uninterrupted steps (optimizer state and per-parameter step counts carried over)."""
    results = dist_run(WORLD, resume_run, saved, resumed, STEPS // 2, MICRO_BS, str(tmp_path / "ckpt"), **TOP1)
    ref_losses, ref_params, unused, _ = reference_run(STEPS, WORLD, MICRO_BS, 1, CLIP, **TOP1)
    assert any(unused[STEPS // 2:]) or any(unused[:STEPS // 2])
    for rank, (losses, full) in enumerate(results):
        assert_matches_reference(rank, losses, full, ref_losses, ref_params, f"resumed at {resumed}")
