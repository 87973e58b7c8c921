"""The benchmark models: the GPT of shared/research/baselines.md and a tiny one for smoke runs.

baseline: vocab 8192, 8 layers, hidden 512, 8 heads, sequence 128, untied head: 33.7M parameters,
the peers' figures in baselines.md were measured on it (AdamW lr 1e-3 wd 0.01, micro-batch 4, fp32).
"""

from __future__ import annotations

import torch

from zerodp.tools.models.gpt import GPTConfig

BENCH_MODELS = {
    "baseline": GPTConfig(vocab_size=8192, block_size=128, n_layer=8, n_head=8, n_embd=512, tie_embeddings=False),
    "small": GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=4, n_embd=256, tie_embeddings=False),
    "tiny": GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, tie_embeddings=False),
}


def synthetic_tokens(step: int, rank: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """A learnable stream: each token follows a fixed successor of the previous one half of the time."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    succ = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (batch,), generator=g)
    noise = torch.randint(vocab, (batch, seq), generator=g)
    keep = torch.rand(batch, seq, generator=g) < 0.5
    for t in range(seq):
        tokens[:, t + 1] = torch.where(keep[:, t], succ[tokens[:, t]], noise[:, t])
    return tokens
