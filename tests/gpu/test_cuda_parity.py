"""The CUDA path (NCCL collectives, device-side flags and norms) trains like plain PyTorch on the GPU.

Skipped where no GPU exists; run on a lent GPU machine with `pytest -m gpu tests/gpu`. One GPU is
enough: NCCL runs with a single rank, and conftest.py switches on ZERODP_REAL_COLLECTIVES, so every
collective is really issued (not skipped as at world size 1 by default), on zerodp's own tensors' devices.
"""


import pytest
import torch
import torch.nn.functional as F

import zerodp
from tests.dist.common import global_batch, make_model, make_optimizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]




@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cuda_parity(nccl_group, stage, precision):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, model = make_model().cuda(), make_model().cuda()
    ref_opt = make_optimizer("adamw", ref)
    cfg = {"gradient_clipping": 0.5, "zero_optimization": {"stage": stage}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        ref = ref.to(torch.bfloat16)  # reference: plain bf16 forward, compared on losses only
    engine = zerodp.initialize(model, make_optimizer("adamw", model), cfg)
    for step in range(4):
        x, y = (t.cuda() for t in global_batch(step, 8))
        loss = F.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        if precision == "fp32":
            ref_loss = F.mse_loss(ref(x), y)
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        assert torch.isfinite(loss)
    assert engine.global_step == 4
