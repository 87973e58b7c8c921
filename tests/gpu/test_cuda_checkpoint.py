"""Checkpoints on the CUDA path: a bf16 engine on one GPU (NCCL, one rank) saves, resumes exactly and
consolidates on the CPU; optimizer state lands on the device torch expects, CUDA RNG included.

Skipped where no GPU exists; run on a lent GPU machine with `pytest -m gpu tests/gpu`.
"""


import pytest
import torch
import torch.nn.functional as F

import zerodp
from tests.dist.common import global_batch, make_model, make_optimizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]




def train(engine, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        x, y = (t.cuda() for t in global_batch(step, 8))
        x = x + 0.1 * torch.randn_like(x)  # draws from the CUDA generator, which the checkpoint restores
        loss = F.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cuda_checkpoint_round_trip(nccl_group, tmp_path, stage):
    torch.backends.cuda.matmul.allow_tf32 = False
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
    model = make_model().cuda()
    engine = zerodp.initialize(model, make_optimizer("adamw", model), config)
    train(engine, 0, 2)
    engine.save_checkpoint(tmp_path)
    saved = engine.full_state_dict()
    uninterrupted = train(engine, 2, 2)

    fresh = make_model(seed=3).cuda()
    resumed = zerodp.initialize(fresh, make_optimizer("adamw", fresh), config)
    resumed.load_checkpoint(tmp_path)
    loaded = resumed.full_state_dict()
    assert all(v.device.type == "cpu" and torch.equal(loaded[k], v) for k, v in saved.items())
    state = resumed.optimizer.state_of(0)
    # CUDA masters step with fused AdamW (optim/step_kernel.py), whose `step` torch keeps on the device
    assert state["exp_avg"].is_cuda and state["step"].device == state["exp_avg"].device
    # the same kernels on the same inputs: equal up to nondeterministic GPU reductions, if any
    torch.testing.assert_close(torch.tensor(train(resumed, 2, 2)), torch.tensor(uninterrupted), rtol=1e-6, atol=0)
    consolidated = zerodp.consolidate_checkpoint(tmp_path)
    assert all(torch.equal(consolidated[k], v) for k, v in saved.items())
