"""[Note: sliced chunks] (optim/step_counts.py): a Mixture-of-Experts step steps the routed experts' slices alone,
with no snapshot and restore of the experts no token reached, and stays torch's update for every parameter
(one process; multi-rank parity with late parameters: tests/dist/test_step_counts.py; the step's time against
torch's: bench/moe_optimizer_step.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerodp
from tests.dist.moe_common import IN, OUT, ClassicMoE
from tests.oracle import train_reference

STEPS = 6


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, IN, generator=g), torch.randn(4, OUT, generator=g)


@pytest.mark.parametrize("stage", [1, 3])
def test_moe_step_touches_only_routed_experts_and_equals_torch(stage):
    torch.manual_seed(0)
    ref = ClassicMoE(width=32, experts=16, layers=1)
    model = ClassicMoE(width=32, experts=16, layers=1)
    model.load_state_dict(ref.state_dict())
    train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1), STEPS,
                    lambda net, step: F.mse_loss(net(batch(step)[0]), batch(step)[1]))
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                               {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    sharded = engine.optimizer
    snapshotted, sliced = [], []
    snapshot, step_sliced = sharded._snapshot_untouched, sharded.step_counts.step_sliced

    def counting_snapshot(*args, **kwargs):
        saved = snapshot(*args, **kwargs)
        snapshotted.append(sum(value.numel() for _, _, value, _ in saved))
        return saved

    def counting_sliced(owner, plan):
        sliced.append(len(plan))
        return step_sliced(owner, plan)

    sharded._snapshot_untouched = counting_snapshot
    sharded.step_counts.step_sliced = counting_sliced
    used = []
    for step in range(STEPS):
        x, y = batch(step)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        used.append(set(model.used_experts()[0]))
    assert any(len(u) < 16 for u in used[1:]), "every expert was routed on every step: not the case"
    # after the first step (which creates the state), untouched and late experts cost no copy at all
    assert snapshotted[1:] == [0] * (STEPS - 1), snapshotted
    assert any(sliced[1:]), "no chunk was stepped slice by slice"
    with zerodp.gathered_parameters(model.parameters()):
        got = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.close()
    for key, value in ref.state_dict().items():
        # one process, the same gradients: only the kernel's grouping of tensors may differ (fp32 rounding)
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
