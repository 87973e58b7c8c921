"""The CUDA path (NCCL collectives, device-side flags and norms) trains like plain PyTorch on the GPU:
stages 0-3 in fp32 and bf16, losses of every step and the parameters after 8 steps compared against a
plain PyTorch run in the same test.

Skipped where no GPU exists; run on a lent GPU machine with `make test-gpu` (docs/gpu.md). One GPU is
enough: NCCL runs with a single rank, and conftest.py switches on ZERODP_REAL_COLLECTIVES, so every
collective is really issued (not skipped as at world size 1 by default), on zerodp's own tensors' devices.
"""


import pytest
import torch
import torch.nn.functional as F

import zerodp
from tests.dist.common import global_batch, make_model, make_optimizer, mixed_precision_reference
from tests.oracle import train_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS, ROWS, CLIP = 8, 8, 0.5
ADAM_LR = 1e-2  # tests.dist.common.make_optimizer("adamw")
# bf16 tolerance, as tests/dist/test_precision.py argues: 16-bit rounding of gradients summed in another order
# shifts losses by about one bf16 rounding; 2 ulps relative (2^-7) allowed.
BF16_RTOL = 8e-3


def _fp32_reference() -> tuple[list[float], dict]:
    """The oracle on the GPU: the same model, data and clipping in plain PyTorch."""
    def step_loss(model, step: int) -> torch.Tensor:
        x, y = (t.cuda() for t in global_batch(step, ROWS))
        return F.mse_loss(model(x), y)

    ref = make_model().cuda()
    result = train_reference(ref, make_optimizer("adamw", ref), STEPS, step_loss, clip=CLIP)
    return result.losses, {k: v.cpu() for k, v in result.params.items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cuda_parity(nccl_group, stage, precision):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_model().cuda()
    cfg = {"gradient_clipping": CLIP, "zero_optimization": {"stage": stage}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine = zerodp.initialize(model, make_optimizer("adamw", model), cfg)
    losses = []
    for step in range(STEPS):
        x, y = (t.cuda() for t in global_batch(step, ROWS))
        loss = F.mse_loss(engine(x.to(torch.bfloat16) if precision == "bf16" else x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert engine.global_step == STEPS
    with zerodp.gathered_parameters(model.parameters()):  # stage 3: full values; other stages: as they are
        params = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    engine.close()
    if precision == "fp32":
        ref_losses, ref_params = _fp32_reference()
        # the same fp32 kernels on one rank (TF32 off): equal up to the order of the clipping norm's sum
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        return
    # plain bf16 compute with fp32 masters, clipped on the masters: what bf16 training means
    batches = [(x.cuda().to(torch.bfloat16), y.cuda()) for x, y in (global_batch(s, ROWS) for s in range(STEPS))]
    ref_losses, ref_params = mixed_precision_reference(make_model().cuda().to(torch.bfloat16),
                                                       lambda params: make_optimizer("adamw", params), batches,
                                                       lambda out, y, m: F.mse_loss(out.float(), y), CLIP)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=BF16_RTOL, atol=0)
    for name, ref in ref_params.items():
        ref = ref.cpu()
        close = (params[name] - ref).abs() <= BF16_RTOL * (ref.abs() + ref.abs().max())
        # tests/dist/test_precision.py's rule: Adam moves an element whose gradient is near zero by about lr
        # with that gradient's sign, which 16-bit rounding can flip (up to 2 lr per step); all else 2 ulps
        assert float((params[name] - ref).abs().max()) <= 2 * ADAM_LR * STEPS, name
        assert float(close.float().mean()) >= 0.98, f"{name}: too many elements differ beyond 2 bf16 ulps"
