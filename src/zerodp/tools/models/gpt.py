"""A GPT-style decoder-only language model in plain PyTorch: the example workload.

Pre-LayerNorm transformer blocks, causal self-attention through
``F.scaled_dot_product_attention(is_causal=True)`` (no T x T matrix is materialized on the
fused kernels), a GELU MLP, learned position embeddings and, by default, an output head tied to
the token embedding. Attention has no biases: a key bias gets an exactly-zero true gradient, and
float noise there turns into sign-random Adam updates that make parity tests flaky.

Parameter count (``estimate_model_numel`` in ``zerodp.tools.plan`` keeps the same formula):
``V*C + T*C + L*(12*C^2 + 9*C) + 2*C`` (+ ``V*C`` when the head is not tied),
with V=vocab_size, T=block_size, L=n_layer, C=n_embd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256
    """Number of token ids (256 for the byte-level corpus)."""
    block_size: int = 128
    """Longest sequence the model accepts (size of the position embedding)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream."""
    tie_embeddings: bool = True
    """Use the token embedding matrix as the output head (one Parameter, counted once)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches (0 disables it)."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


MODEL_PRESETS: dict[str, GPTConfig] = {
    # ~0.12M parameters: unit and multi-rank tests.
    "tiny": GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64),
    # ~3.3M parameters: the default `zerodp train` job on CPU ranks.
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256),
    # ~25.4M parameters: benchmarks on a GPU.
    "base": GPTConfig(block_size=256, n_layer=8, n_head=8, n_embd=512),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, 3C) -> three (B, H, T, C/H) views of one buffer.
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only LM: ``forward(idx) -> logits`` of shape (B, T, vocab_size).

    Initialization is GPT-2's: normal(0, 0.02) for weights and embeddings, zeros for biases, and
    the two residual projections of each block scaled by 1/sqrt(2*n_layer) so that the residual
    stream's variance does not grow with depth. Given ``seed``, the weights come from a private
    generator and do not depend on (or advance) torch's global RNG; otherwise they follow it.
    """

    def __init__(self, config: GPTConfig, *, seed: int | None = None):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # one Parameter, two uses
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.reset_parameters(generator)
        # Activation checkpointing of the blocks: None, or a function called as fn(block, x), e.g.
        # zerodp.activations.checkpoint (how the inputs are kept is that function's configuration).
        self.checkpoint_fn: Callable[..., torch.Tensor] | None = None

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Re-draw every parameter in ``named_parameters()`` order (tied weights once)."""
        for name, param in self.named_parameters():
            init_parameter(name, param, self.config.n_layer, generator)

    def num_parameters(self) -> int:
        """Number of parameter elements, counting a tied weight once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x) if self.checkpoint_fn is None else self.checkpoint_fn(block, x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T); returns (B, T + new).

        The context is cropped to the last ``block_size`` tokens. ``temperature <= 0`` means
        greedy decoding; ``top_k`` keeps only the k most likely tokens before sampling.
        """
        return sample_tokens(self, idx, self.config.block_size, max_new_tokens, temperature, top_k, generator)


@torch.no_grad()
def sample_tokens(logits_of, idx: torch.Tensor, block_size: int, max_new_tokens: int, temperature: float = 1.0,
                  top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """GPT.generate's loop over any `logits_of(context) -> (B, T, vocab)` (models/tp_gpt.py gathers its slices)."""
    for _ in range(max_new_tokens):
        context = idx[:, -block_size:]
        logits = logits_of(context)[:, -1, :].float()
        if temperature <= 0:
            next_token = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            next_token = torch.multinomial(probs, 1, generator=generator)
        idx = torch.cat([idx, next_token.to(idx.dtype)], dim=1)
    return idx


@torch.no_grad()
def init_parameter(name: str, param: torch.Tensor, n_layer: int, generator: torch.Generator | None = None) -> None:
    """GPT-2's initial value of parameter `name` (see GPT), drawn in place; models/tp_gpt.py draws with it too."""
    if name.startswith("ln") or ".ln_" in name:
        if name.endswith("weight"):
            param.fill_(1.0)
        else:
            param.zero_()
    elif name.endswith("bias"):
        param.zero_()
    elif name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
        param.normal_(0.0, 0.02 / math.sqrt(2 * n_layer), generator=generator)
    else:
        param.normal_(0.0, 0.02, generator=generator)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all B*T positions.

    Logits are upcast to fp32 first: a bf16/fp16 log-softmax over the vocabulary loses precision.
    """
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
