"""The CUDA path (NCCL collectives, device-side flags and norms) trains like plain PyTorch on the GPU.

Skipped where no GPU exists; run on a lent GPU machine with `pytest -m gpu tests/gpu`. One GPU is
enough: NCCL runs with a single rank, and conftest.py switches on ZERODP_REAL_COLLECTIVES, so every
collective is really issued (not skipped as at world size 1 by default), on zerodp's own tensors' devices.
"""


import pytest
import torch
import torch.nn.functional as F

import zerodp
from tests.dist.common import global_batch, make_model, make_optimizer, mixed_precision_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]




# bf16 tolerance, as tests/dist/test_precision.py argues: 16-bit rounding of gradients summed in another order
# shifts losses by about one bf16 rounding; 2 ulps relative (2^-7) allowed.
BF16_RTOL = 8e-3


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cuda_parity(nccl_group, stage, precision):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_model().cuda()
    cfg = {"gradient_clipping": 0.5, "zero_optimization": {"stage": stage}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine = zerodp.initialize(model, make_optimizer("adamw", model), cfg)
    losses = []
    for step in range(4):
        x, y = (t.cuda() for t in global_batch(step, 8))
        loss = F.mse_loss(engine(x.to(torch.bfloat16) if precision == "bf16" else x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert engine.global_step == 4
    if precision == "fp32":
        ref = make_model().cuda()
        ref_opt = make_optimizer("adamw", ref)
        ref_losses = []
        for step in range(4):
            x, y = (t.cuda() for t in global_batch(step, 8))
            ref_loss = F.mse_loss(ref(x), y)
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(ref_loss.item())
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    else:  # plain bf16 compute with fp32 masters, clipped on the masters: what bf16 training means
        batches = [(x.cuda().to(torch.bfloat16), y.cuda()) for x, y in (global_batch(s, 8) for s in range(4))]
        ref_losses, _ = mixed_precision_reference(make_model().cuda().to(torch.bfloat16),
                                                  lambda params: make_optimizer("adamw", params), batches,
                                                  lambda out, y, m: F.mse_loss(out.float(), y), 0.5)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=BF16_RTOL, atol=0)
