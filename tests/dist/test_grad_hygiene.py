"""A gradient accumulated outside engine.backward (a stray loss.backward()) is refused at every stage,
and discarded: the next step equals a run that never made the stray call, which equals the oracle."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp
from tests.dist.common import make_model, make_optimizer, micro_batch, reference_run
from tests.oracle import assert_params_match_reference


def stray_backward_run(stage: int, stray: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer("sgd", model), {"zero_optimization": {"stage": stage}})
    out = {"error": None}
    for step in range(2):
        x, y = micro_batch(step, 0, rank, world, 2, 1)
        if stray and step == 1:
            try:
                F.mse_loss(engine(x), y).backward()  # the mistake: not engine.backward
            except RuntimeError as err:
                out["error"] = str(err)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    with zerodp.gathered_parameters(list(model.parameters())):
        out["params"] = {k: p.detach().clone() for k, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stray_backward_is_refused_and_discarded(dist_run, stage):
    clean = dist_run(2, stray_backward_run, stage, False)
    stray = dist_run(2, stray_backward_run, stage, True)
    _, ref_params = reference_run("sgd", 2, 4, 0.0)  # 2 steps of the global batch (2 ranks x 2 rows)
    for rank, (c, s) in enumerate(zip(clean, stray)):
        assert s["error"] is not None and "call engine.backward(loss) instead of loss.backward()" in s["error"]
        for key, value in c["params"].items():
            assert torch.equal(value, s["params"][key]), "the stray gradient must not reach the next step"
        assert_params_match_reference(rank, c["params"], ref_params, f"stage {stage}")
