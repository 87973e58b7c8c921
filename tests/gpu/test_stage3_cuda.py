"""Stage 3 on CUDA: gathers and reductions on their side streams (events, record_stream) train like
plain PyTorch, and every gathered buffer is released after each step.

Skipped where no GPU exists; run on a GPU machine with `pytest -m gpu tests/gpu/test_stage3_cuda.py`.
One GPU is enough: NCCL with a single rank, and conftest.py's ZERODP_REAL_COLLECTIVES=1 makes every
collective really run on the side streams (zerodp skips them at world size 1 by default).
"""

from __future__ import annotations


import pytest
import torch

import zerodp
from zerodp.tools.models.gpt import GPT, GPTConfig, lm_loss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]




def gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=3, n_head=2, n_embd=32), seed=7)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage3_cuda_streams_match_pytorch(nccl_group, precision):
    torch.backends.cuda.matmul.allow_tf32 = False
    model, ref = gpt().cuda(), gpt().cuda()
    if precision == "bf16":  # the reference computes in bf16 too, stepping fp32 masters (below)
        ref = ref.to(torch.bfloat16)
        masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    cfg = {"zero_optimization": {"stage": 3, "stage3_unit_modules": ["Block"], "stage3_param_persistence_threshold": 40,
                                 "stage3_prefetch_bucket_size": 20_000, "stage3_max_live_parameters": 40_000}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), cfg)
    ref_opt = torch.optim.SGD(masters if precision == "bf16" else ref.parameters(), lr=0.1, momentum=0.9)
    assert engine.sharding.shards.gather_stream is not None  # the side-stream path is the one under test
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randint(0, 61, (4, 17), generator=g).cuda()
        loss = lm_loss(engine(ids[:, :-1]), ids[:, 1:])
        engine.backward(loss)
        engine.step()
        assert engine.sharding.live_numel == 0
        assert all(f.gathered.nbytes == 0 for f in engine.sharding.flats if not f.persistent)
        ref_loss = lm_loss(ref(ids[:, :-1]), ids[:, 1:])
        ref_loss.backward()
        if precision == "bf16":
            for p, m in zip(ref.parameters(), masters):
                m.grad = p.grad.float()
        ref_opt.step()
        ref_opt.zero_grad()
        ref.zero_grad(set_to_none=True)
        if precision == "fp32":
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        else:
            with torch.no_grad():
                for p, m in zip(ref.parameters(), masters):
                    p.copy_(m)
            # 2 bf16 ulps relative (tests/dist/test_precision.py's argument)
            torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=8e-3, atol=0)
    if precision == "fp32":
        with zerodp.gathered_parameters(model.parameters()):
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
