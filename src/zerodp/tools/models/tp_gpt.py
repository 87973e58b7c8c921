"""The GPT of models/gpt.py with Megatron's tensor parallelism: each rank of a tensor-parallel group holds
1/tp of every block's attention heads and MLP width and of the vocabulary (Shoeybi et al. 2019).

    wte        VocabParallelEmbedding (rows split), also the tied output head: logits of this rank's slice
    wpe        nn.Embedding, replicated
    attn.qkv   ColumnParallelLinear, stride 3 (this rank's heads' q, k and v rows); attn.proj RowParallelLinear
    mlp.fc     ColumnParallelLinear (its bias split too);                         mlp.proj RowParallelLinear
    ln_*       replicated; the row-parallel biases are replicated

Parameter names, order and initial values are gpt.py's: with `seed`, every whole parameter is drawn as
`GPT(config, seed=seed)` draws it and each rank keeps its part, so a tensor-parallel model starts as the
unsharded one, and `layout.merge_state_dicts` of the ranks' state dicts loads into `GPT`. At tp=1 the
forward is gpt.py's math.

Dropout: on the replicated residual stream it draws from torch's default generator, seeded alike on every
tensor-parallel rank; on the attention probabilities (this rank's heads only) it draws inside
`rng.fork()`, the model-parallel stream of a `tensor_parallel.RNGStatesTracker` (deepspeed.checkpointing's
`get_cuda_rng_tracker()` is one), which differs per tensor-parallel rank.
The forward returns this rank's slice of the logits; `tp_lm_loss` is the vocab-parallel cross entropy.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ...tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ...tensor_parallel.layout import tensor_parallel_specs
from ...tensor_parallel.mappings import gather_from_tensor_parallel
from .gpt import GPTConfig, init_parameter, sample_tokens


class AttentionCore(nn.Module):
    """Causal attention of this rank's heads; its dropout draws from the model-parallel stream `rng`."""

    def __init__(self, dropout: float, rng: Any = None) -> None:
        super().__init__()
        self.dropout, self.rng = dropout, rng

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        stream = self.rng.fork() if p > 0 and self.rng is not None else contextlib.nullcontext()
        with stream:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


class ParallelAttention(nn.Module):
    def __init__(self, config: GPTConfig, group, rng) -> None:
        super().__init__()
        self.qkv = ColumnParallelLinear(config.n_embd, 3 * config.n_embd, group, bias=False, stride=3)
        self.proj = RowParallelLinear(config.n_embd, config.n_embd, group, bias=False)
        self.resid_drop = nn.Dropout(config.dropout)
        self.core = AttentionCore(config.dropout, rng)
        self.head_dim = config.n_embd // config.n_head
        if config.n_head % self.qkv.tp_size:
            raise ValueError(f"n_head={config.n_head} is not divisible by the tensor-parallel size {self.qkv.tp_size}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        y = self.core(q, k, v).transpose(1, 2).reshape(B, T, -1)
        return self.resid_drop(self.proj(y))


class ParallelMLP(nn.Module):
    def __init__(self, config: GPTConfig, group) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(config.n_embd, 4 * config.n_embd, group)
        self.proj = RowParallelLinear(4 * config.n_embd, config.n_embd, group)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class ParallelBlock(nn.Module):
    def __init__(self, config: GPTConfig, group, rng) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = ParallelAttention(config, group, rng)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = ParallelMLP(config, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TensorParallelGPT(nn.Module):
    """`forward(idx) -> logits` of this rank's vocabulary slice, (B, T, vocab_size / tp); see the module docstring.

    `mpu`: an object with Megatron's `get_tensor_model_parallel_group()` (None: no tensor parallelism);
    `rng`: the tracker whose `fork()` the attention dropout draws in (None: torch's default generator).
    """

    def __init__(self, config: GPTConfig, mpu: Any = None, *, rng: Any = None, seed: Optional[int] = None) -> None:
        super().__init__()
        self.config = config
        self.group = None if mpu is None else mpu.get_tensor_model_parallel_group()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, self.group)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(ParallelBlock(config, self.group, rng) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = None if config.tie_embeddings else \
            ColumnParallelLinear(config.n_embd, config.vocab_size, self.group, bias=False)
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.reset_parameters(generator)
        # Activation checkpointing of the blocks: None, or a function called as fn(block, x) (e.g. DeepSpeed's
        # deepspeed.checkpointing.checkpoint, which partitions the kept inputs over the tensor-parallel group)
        self.checkpoint_fn: Optional[Callable[..., torch.Tensor]] = None

    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """Draw every whole parameter as gpt.GPT does (same order, same generator) and keep this rank's part."""
        specs = tensor_parallel_specs(self)
        tp = self.wte.tp_size
        owners = {f"{prefix}.{local}" if prefix else local: (module, local)
                  for prefix, module in self.named_modules() for local, _ in module.named_parameters(recurse=False)}
        for name, param in self.named_parameters():
            shape = list(param.shape)
            if name in specs:
                shape[specs[name].dim] *= tp
            whole = torch.empty(shape, dtype=param.dtype)
            init_parameter(name, whole, self.config.n_layer, generator)
            module, local = owners[name]
            if hasattr(module, "load_whole"):
                module.load_whole(local, whole)
            else:
                param.copy_(whole)

    def num_parameters(self) -> int:
        """Parameter elements this rank holds (its shards and the replicated parameters)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x) if self.checkpoint_fn is None else self.checkpoint_fn(block, x)
        x = self.ln_f(x)
        return self.wte.parallel_logits(x) if self.lm_head is None else self.lm_head(x)


    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """GPT.generate over the whole vocabulary (each step all-gathers the last position's logit slices); every
        tensor-parallel rank must call it with the same generator state, and so samples the same tokens."""
        def whole_logits(context: torch.Tensor) -> torch.Tensor:
            return gather_from_tensor_parallel(self(context)[:, -1:, :], self.group)

        return sample_tokens(whole_logits, idx, self.config.block_size, max_new_tokens, temperature, top_k, generator)


def tp_lm_loss(logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """Mean next-token cross entropy from vocab-split logits (gpt.lm_loss at tp=1), in fp32."""
    return vocab_parallel_cross_entropy(logits, targets, group).mean()
