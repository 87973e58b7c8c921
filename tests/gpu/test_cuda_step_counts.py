"""[Note: one step count per parameter] (optim/step_counts.py) on the GPU: CUDA masters step with torch's fused AdamW,
whose `step` lives on the device, so a late parameter's own count must be made there too. A branch first used at
step 1 that skips step 3 trains as plain torch.optim.AdamW trains it on the GPU (fp32, stages 1 and 3; bf16 is
covered on the CPU by tests/dist/test_step_counts.py). Skipped where no GPU exists (`make test-gpu`)."""

import pytest
import torch
import torch.nn.functional as F

import zerodp
from tests.dist.common import mixed_precision_reference
from tests.unit.optim.test_step_counts import PATHS, Branch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LR, WD = 2e-2, 0.1


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(3, 5, generator=g).cuda(), torch.randn(3, 7, generator=g).cuda()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_late_branch_trains_as_torch_adamw_on_the_gpu(nccl_group, stage):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = Branch().cuda()
    cfg = {"zero_optimization": {"stage": stage}}
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), cfg)
    for step, use_b in enumerate(PATHS):
        x, y = batch(step)
        engine.backward(F.mse_loss(engine(x, use_b).float(), y))
        engine.step()
    with zerodp.gathered_parameters(model.parameters()):
        got = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    counts = engine.optimizer.param_steps()
    assert counts[id(model.a.weight)] == len(PATHS) and counts[id(model.b.weight)] == PATHS.count(True), counts
    engine.close()
    ref_model = Branch().cuda()
    paths = iter(PATHS)
    _, ref = mixed_precision_reference(
        _PathModel(ref_model, paths), lambda ps: torch.optim.AdamW(ps.parameters(), lr=LR, weight_decay=WD),
        (batch(step) for step in range(len(PATHS))),
        lambda out, y, m: F.mse_loss(out.float(), y), clip=0.0)
    for key, value in ref.items():
        # zerodp's fused kernel vs the reference's foreach one: fp32 rounding only (a chunk-count first update of b
        # would be off by ~lr/4)
        torch.testing.assert_close(got[key.removeprefix("inner.")], value, rtol=1e-5, atol=1e-6)


class _PathModel(torch.nn.Module):
    """The reference model called as model(x): takes the next step's path."""

    def __init__(self, inner, paths) -> None:
        super().__init__()
        self.inner, self.paths = inner, paths

    def forward(self, x):
        return self.inner(x, next(self.paths))
