"""The model workload of one training step: a transformer's shape, its parameter counts and its FLOPs.

Pure arithmetic (no torch). Two parameter counts matter and differ:
- `numel` (Psi): every parameter, the bytes ZeRO shards and moves;
- `matmul_numel` (N): the parameters that multiply activations (every Linear, including the output
  head; not the token or position embeddings, which are lookups), the N of the FLOP count.

FLOPs per token of a training step (forward + backward), the formula of PaLM's MFU definition
(Chowdhery et al. 2022, appendix B) and torchtitan's `get_num_flop_per_token`:

    model_flops_per_token = 6 * N + 12 * layers * hidden * seq_len

(6N: a multiply-add is 2 FLOPs, the backward costs twice the forward; the second term is the
attention score and value matmuls, QK^T and AV, of a causal-free count.) Activation checkpointing
re-runs the forward inside the backward: the hardware does `(8/6)` of the model FLOPs (full
recomputation), which costs time but does not count towards MFU.
"""

from __future__ import annotations

from ....errors import UsageError

from dataclasses import dataclass


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer. `ffn_hidden` and `kv_heads` follow Llama (SwiGLU: three ffn
    matrices, grouped-query attention); `gelu_mlp=True` is GPT-2's two-matrix MLP with biases."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn_hidden: int
    vocab: int
    seq_len: int
    kv_heads: int = 0              # 0: as many as `heads` (multi-head attention)
    gelu_mlp: bool = False         # GPT-2 MLP (2 matrices + biases, LayerNorm with bias) instead of SwiGLU
    learned_positions: bool = False
    tied_head: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_matmul_numel(self) -> int:
        kv = (self.kv_heads or self.heads) * self.head_dim
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv     # q, o and k, v
        mlp = (2 if self.gelu_mlp else 3) * self.hidden * self.ffn_hidden
        return attention + mlp

    @property
    def layer_numel(self) -> int:
        """Every parameter of one block: matmuls, plus biases and norms (GPT-2) or the two RMSNorms (Llama)."""
        if self.gelu_mlp:
            kv = (self.kv_heads or self.heads) * self.head_dim
            biases = self.hidden + 2 * kv + self.hidden + self.ffn_hidden + self.hidden
            return self.layer_matmul_numel + biases + 4 * self.hidden
        return self.layer_matmul_numel + 2 * self.hidden

    @property
    def head_numel(self) -> int:
        """The output projection (the last unit of the forward); 0 when tied to the embedding."""
        return 0 if self.tied_head else self.vocab * self.hidden

    @property
    def numel(self) -> int:
        """Psi: every parameter (embeddings, blocks, final norm, head)."""
        final_norm = 2 * self.hidden if self.gelu_mlp else self.hidden
        positions = self.seq_len * self.hidden if self.learned_positions else 0
        return (self.vocab * self.hidden + positions + self.layers * self.layer_numel + final_norm
                + self.head_numel)

    @property
    def matmul_numel(self) -> int:
        """N of 6N: the Linear weights, the output head included (it multiplies even when tied)."""
        return self.layers * self.layer_matmul_numel + self.vocab * self.hidden

    def model_flops_per_token(self) -> float:
        """6N + 12 * layers * hidden * seq_len (see the module docstring)."""
        return 6.0 * self.matmul_numel + 12.0 * self.layers * self.hidden * self.seq_len


@dataclass(frozen=True)
class Workload:
    """One training step of `shape` on every data-parallel rank: `tokens_per_rank` tokens each, in
    micro-steps of `micro_tokens` (the micro-batch; 0: one micro-step), parameters and gradients
    communicated in `comm_bytes` per element (2: bf16/fp16; 4: fp32), optionally with full
    activation checkpointing."""

    shape: TransformerShape
    tokens_per_rank: int
    comm_bytes: int = 2
    checkpointing: bool = False
    micro_tokens: int = 0

    def __post_init__(self):
        micro = self.micro_tokens or self.tokens_per_rank
        if self.tokens_per_rank < 1 or micro < 1 or self.tokens_per_rank % micro:
            raise ValueError(f"tokens per rank ({self.tokens_per_rank}) must be a positive multiple of the "
                             f"micro-batch tokens ({micro}): lower the GPU count or raise the global batch")

    @property
    def micro_steps(self) -> int:
        """Gradient-accumulation steps per optimizer step."""
        return self.tokens_per_rank // (self.micro_tokens or self.tokens_per_rank)

    @property
    def model_flops_per_rank(self) -> float:
        """What MFU counts: the model's FLOPs for this rank's tokens."""
        return self.shape.model_flops_per_token() * self.tokens_per_rank

    @property
    def hardware_flops_per_rank(self) -> float:
        """What the device executes: full checkpointing re-runs the forward's matmuls (+2N per token)."""
        extra = 2.0 * self.shape.matmul_numel * self.tokens_per_rank if self.checkpointing else 0.0
        return self.model_flops_per_rank + extra


# Llama-like shapes (published configs): Llama-2-7B, Llama-2-70B (GQA with 8 kv heads, as Llama-3-70B),
# Llama-3.1-8B (torchtitan's benchmark model). Sequence lengths are the models' training lengths.
LLAMA_7B = TransformerShape("llama-7b", layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=32000,
                            seq_len=4096)
LLAMA_70B = TransformerShape("llama-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672,
                             vocab=32000, seq_len=4096)
LLAMA3_8B = TransformerShape("llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                             vocab=128256, seq_len=8192)
# The benchmark GPT of bench/ (bench/harness/models.py): 33,674,240 parameters.
BENCH_GPT = TransformerShape("bench-gpt", layers=8, hidden=512, heads=8, ffn_hidden=2048, vocab=8192,
                             seq_len=128, gelu_mlp=True, learned_positions=True)

SHAPES = {s.name: s for s in (LLAMA_7B, LLAMA_70B, LLAMA3_8B, BENCH_GPT)}
SIZE_ALIASES = {"7b": LLAMA_7B, "70b": LLAMA_70B, "8b": LLAMA3_8B}


def shape_for_count(numel: float, seq_len: int = 4096) -> TransformerShape:
    """A Llama-like shape of about `numel` parameters (at least 1e8): the widest hidden size (a
    multiple of 128) whose shape with layers = hidden / 128 (the 7B-70B aspect ratio) stays within
    the count, then as many layers as the count allows; ffn = 8/3 * hidden rounded to 256, vocab 32000.
    For `zerodp estimate --cluster --model-size <count>`."""
    if numel < 1e8:
        raise ValueError(f"{numel:.3g} parameters is too small for a Llama-like shape (32000-token vocabulary); "
                         "give at least 1e8")

    def shape(hidden: int, layers: int) -> TransformerShape:
        return TransformerShape(f"llama-like-{numel:.3g}", layers, hidden, max(1, hidden // 128), _ffn(hidden),
                                32000, seq_len)

    hidden = 128
    while shape(hidden + 128, (hidden + 128) // 128).numel <= numel:
        hidden += 128
    one = shape(hidden, 1)
    layers = max(1, round((numel - (one.numel - one.layer_numel)) / one.layer_numel))
    return shape(hidden, layers)


def _ffn(hidden: int) -> int:
    return max(256, 256 * round(hidden * 8 / 3 / 256))


def parse_count(text: str) -> float:
    """'7.5e9', '7.5B', '350M', '1T', '120K' -> a number of parameters."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    t = text.strip().upper()
    try:
        value = float(t[:-1]) * scale[t[-1]] if t and t[-1] in scale else float(t)
    except ValueError:
        raise UsageError(f"--params {text!r} is not a number (examples: 7.5e9, 7.5B, 350M, 1T)") from None
    if not value >= 1:
        raise UsageError(f"--params must be at least 1, got {text}")
    return value
