"""docs/precision.md's two claims, on synthetic bf16 gradients through zerodp's own arithmetic
(bench/bf16_reduction_error.py's replay of stages 2-3): with 16 accumulated micro-steps fp32 accumulation
leaves several times less error than bf16's, and over 8 ranks an fp32 reduction less than a bf16 one."""

from __future__ import annotations

import torch

from bench.bf16_reduction_error import relative_error


def _grads(ranks: int, micro_steps: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4096, generator=g)  # ranks' gradients share a direction, as real ones do
    return [[(base + 0.5 * torch.randn(4096, generator=g)).to(torch.bfloat16) / micro_steps for _ in range(ranks)]
            for _ in range(micro_steps)]


def test_fp32_accumulation_removes_most_of_the_accumulated_error():
    grads = _grads(2, 16)
    bf16 = relative_error(grads, torch.bfloat16, torch.bfloat16)
    fp32_acc = relative_error(grads, torch.bfloat16, torch.float32)
    assert fp32_acc < bf16 / 3, (fp32_acc, bf16)


def test_fp32_reduction_removes_the_error_that_grows_with_the_ranks():
    grads = _grads(8, 1)
    assert relative_error(grads, torch.float32, torch.bfloat16) < relative_error(grads, torch.bfloat16, torch.bfloat16)
    assert relative_error(grads, torch.float32, torch.float32) < 1e-6  # only the inputs' bf16 rounding remains
