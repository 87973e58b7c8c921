"""ZeRO-Offload's gradients copied to the host as they are reduced (optim/grad_staging.py), run on the CPU by
forcing the host-step placement (as test_placement.py does): with gradient accumulation, fp16 loss scaling and
clipping, the step that reads the copies queued at the boundary's deliveries is bitwise the step in place."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import zerodp
import zerodp.engine as engine_module
from tests.dist.common import global_batch, make_model, make_optimizer
from zerodp.placement import HOST, Home

STEPS, GAS = 3, 2


def _train(cfg: dict, forced: bool):
    """STEPS optimizer steps of GAS micro-steps each; the final parameters and the staging's copy count."""
    original = engine_module.placement_of
    if forced:  # the GPU's ZeRO-Offload placement, with the host as the "device" (copies change no value)
        def forced_placement(config, device):
            p = original(config, device)
            return dataclasses.replace(p, masters_are_shards=False, grad_staging=Home(HOST, torch.float32),
                                       param_staging=Home(HOST, p.compute.dtype))
        engine_module.placement_of = forced_placement
    try:
        model = make_model()
        with zerodp.initialize(model, make_optimizer("adamw", model), cfg) as engine:
            for step in range(STEPS):
                for micro in range(GAS):
                    x, y = global_batch(step * GAS + micro, 4)
                    engine.backward(F.mse_loss(engine(x).float(), y))
                    engine.step()
            staging = engine.optimizer.plan.staging
            copies = (staging.staged_copies if staging is not None else 0, len(engine.units))
            return engine.full_state_dict(), copies
    finally:
        engine_module.placement_of = original


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_staged_at_their_last_reduction_step_bitwise_as_in_place(stage, precision):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.05,
           "zero_optimization": {"stage": stage}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True, **({"initial_scale_power": 4} if precision == "fp16" else {})}
    plain, _ = _train(cfg, forced=False)
    staged, (copies, _) = _train(cfg, forced=True)
    assert copies >= STEPS  # the step read copies queued at deliveries (a stage-3 unit untouched: copied at the step)
    for key in plain:
        assert torch.equal(plain[key], staged[key]), key
    fresh = make_model().state_dict()
    assert not torch.equal(fresh["hidden.weight"], plain["hidden.weight"].to(fresh["hidden.weight"].dtype))


def test_only_the_boundary_deliveries_are_staged():
    """Stage 2 reduces every bucket at every micro-step; only the boundary's reductions are the step's: one copy
    per bucket per step, not one per micro-step."""
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "zero_optimization": {"stage": 2}}
    _, (copies, units) = _train(cfg, forced=True)
    assert copies == STEPS * units
