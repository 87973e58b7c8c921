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
from tests.oracle import mixed_precision_reference, train_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]




def gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=3, n_head=2, n_embd=32), seed=7)


def token_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 61, (4, 17), generator=g).cuda() for _ in range(4)]


def reference(precision: str) -> tuple[list[float], dict]:
    """The oracle: fp32 plain PyTorch, or (bf16) the model computing in bf16 and stepping fp32 masters."""
    batches, ref = token_batches(), gpt().cuda()
    if precision == "fp32":
        result = train_reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), len(batches),
                                 lambda model, step: lm_loss(model(batches[step][:, :-1]), batches[step][:, 1:]))
        return result.losses, result.params
    return mixed_precision_reference(ref.to(torch.bfloat16),
                                     lambda params: torch.optim.SGD(params.parameters(), lr=0.1, momentum=0.9),
                                     [(ids[:, :-1], ids[:, 1:]) for ids in batches],
                                     lambda out, y, model: lm_loss(out, y), clip=0.0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage3_cuda_streams_match_pytorch(nccl_group, precision):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_losses, ref_params = reference(precision)
    model = gpt().cuda()
    cfg = {"zero_optimization": {"stage": 3, "stage3_unit_modules": ["Block"], "stage3_param_persistence_threshold": 40,
                                 "stage3_prefetch_bucket_size": 20_000, "stage3_max_live_parameters": 40_000}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), cfg)
    assert engine.sharding.shards.gather_stream is not None  # the side-stream path is the one under test
    for ids, ref_loss in zip(token_batches(), ref_losses):
        loss = lm_loss(engine(ids[:, :-1]), ids[:, 1:])
        engine.backward(loss)
        engine.step()
        assert engine.sharding.live_numel == 0
        assert all(f.gathered.nbytes == 0 for f in engine.sharding.flats if not f.persistent)
        if precision == "fp32":
            torch.testing.assert_close(loss.item(), ref_loss, rtol=1e-5, atol=0)
        else:  # 2 bf16 ulps relative (tests/dist/test_precision.py's argument)
            torch.testing.assert_close(float(loss.float()), ref_loss, rtol=8e-3, atol=0)
    if precision == "fp32":
        with zerodp.gathered_parameters(model.parameters()):
            for name, p in model.named_parameters():
                torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
