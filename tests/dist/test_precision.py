"""bf16 and fp16 training matches plain-PyTorch mixed precision; an fp16 overflow on one rank skips
the step on every rank and lowers the loss scale."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp
from tests.dist.common import make_model, make_optimizer, micro_batch, reference_mixed_run, zerodp_run

STEPS, MICRO_BS, GAS, CLIP = 6, 2, 2, 0.5


def config(stage: int, precision: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BS, "gradient_accumulation_steps": GAS,
           "gradient_clipping": CLIP, "zero_optimization": {"stage": stage, "reduce_bucket_size": 300}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    else:  # a scale that cannot overflow here, kept fixed for 6 steps, so the reference is static
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}
    return cfg


# Tolerance: the reference computes each weight gradient in one GEMM over the global batch and
# rounds it to 16 bits once; zerodp rounds each rank's micro-batch gradient to 16 bits, then sums
# 16-bit values over micro-steps and ranks (one more rounding per addition). bf16 keeps 8 mantissa
# bits (relative step 2^-8 = 3.9e-3), fp16 11 bits (4.9e-4). Over 6 steps, those gradient
# differences move parameters by a fraction of an ulp of the 16-bit model weights, which shifts
# losses by about one 16-bit rounding: we allow 2 ulps relative (bf16 8e-3, fp16 1e-3).
TOL = {"bf16": 8e-3, "fp16": 1e-3}
ADAM_LR = 1e-2  # tests.dist.common.make_optimizer("adamw")
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world", [2, 3])
def test_mixed_precision_parity(dist_run, world, stage, precision, opt_name):
    results = dist_run(world, zerodp_run, config(stage, precision), opt_name, STEPS, MICRO_BS)
    scale = 256.0 if precision == "fp16" else 1.0
    ref_losses, ref_params = reference_mixed_run(DTYPE[precision], opt_name, STEPS, MICRO_BS * world * GAS,
                                                 CLIP, loss_scale=scale)
    tol = TOL[precision]
    for losses, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=tol, atol=0)
        for name, ref in ref_params.items():
            close = (params[name] - ref).abs() <= tol * (ref.abs() + ref.abs().max())
            if opt_name == "sgd":
                assert bool(close.all()), f"{name}: {int((~close).sum())} elements differ beyond 2 ulps"
            else:
                # Adam moves an element whose gradient is near zero by about lr with the sign of
                # that gradient, which 16-bit rounding can flip: such elements may differ by up to
                # 2 lr per step. Everything else must agree within 2 ulps.
                assert float((params[name] - ref).abs().max()) <= 2 * ADAM_LR * STEPS
                assert float(close.float().mean()) >= 0.98, f"{name}: too many elements differ"


def overflow_run(stage: int) -> dict:
    """Step 0 clean; step 1 gets an inf input on rank 1 only; step 2 clean again."""
    rank = dist.get_rank()
    model = make_model()
    cfg = {"zero_optimization": {"stage": stage},
           "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1}}
    engine = zerodp.initialize(model, make_optimizer("adamw", model), cfg)
    out = {"scales": [], "changed": []}
    for step in range(3):
        x, y = micro_batch(step, 0, rank, dist.get_world_size(), 2, 1)
        if step == 1 and rank == 1:
            x = x.clone()
            x[0, 0] = float("inf")
        before = [p.detach().float().clone() for p in model.parameters()]
        engine.backward(F.mse_loss(engine(x).float(), y))
        engine.step()
        after = [p.detach().float() for p in model.parameters()]
        out["changed"].append(any(not torch.equal(a, b) for a, b in zip(before, after)))
        out["scales"].append(engine.loss_scale)
    out["skipped"] = engine.skipped_steps
    out["global_step"] = engine.global_step
    out["params"] = [p.detach().float().clone() for p in model.parameters()]
    return out


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world", [2])
def test_fp16_overflow_skips_step_on_every_rank(dist_run, world, stage):
    results = dist_run(world, overflow_run, stage)
    for r in results:
        assert r["changed"] == [True, False, True], "the overflow step must change nothing, on every rank"
        assert r["scales"] == [1024.0, 512.0, 512.0], "the scale halves after the overflow"
        assert r["skipped"] == 1 and r["global_step"] == 3
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b), "ranks must hold identical parameters after a skipped step"
