"""The analytic memory model: the ZeRO paper's per-rank model-state formulas, plus activations.

Model states of a data-parallel rank with Psi parameters, N ranks, and per-parameter byte costs
(param_bytes, grad_bytes, K = optimizer_bytes, which includes an fp32 master copy if any):

    stage 0 (plain DP)    (param_bytes + grad_bytes + K) * Psi
    stage 1 (P_os)        (param_bytes + grad_bytes) * Psi + K * Psi / N
    stage 2 (P_os+g)      param_bytes * Psi + (grad_bytes + K) * Psi / N
    stage 3 (P_os+g+p)    (param_bytes + grad_bytes + K) * Psi / N

Mixed-precision Adam is (2, 2, 12): 16 Psi bytes unsharded, as in the paper (Rajbhandari et al.,
SC20, section 3 and Table 1). These are the paper's exact divisions; an implementation pads each
flat buffer to a multiple of N (and maybe an alignment), so a measured shard can exceed Psi/N by
a few elements per rank. Pure arithmetic: no torch, no process group. The stage formula itself lives in
memory/model_states.py (the runtime's), beside the engine's own report (memory/report.py), which compares
its measurement against it; this module builds the planner's tables and limits on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol, Sequence

from ...monitor.model_states import ModelStateBytes, check_stage, predict_model_state_bytes  # noqa: F401 (zerodp.tools.plan's)

GB = 10**9  # the paper's tables use decimal gigabytes

# Fp32 words of optimizer state per parameter, besides any master copy.
OPTIMIZER_STATES: dict[str, int] = {
    "adam": 2,  # exp_avg, exp_avg_sq
    "adamw": 2,
    "lamb": 2,
    "sgd": 1,  # momentum buffer
    "sgd-nomomentum": 0,
    "adagrad": 1,  # sum of squares
    # whole-tensor optimizers (each rank owns whole tensors: see whole_tensor_shard_numel)
    "muon": 1,  # momentum buffer
    "adafactor": 0,  # row + column moments of each matrix: (m + n) per m*n elements, ~0 per element
}

# Optimizers whose state follows whole-tensor ownership (flat/whole_tensor_layout.py) under ZeRO.
WHOLE_TENSOR_OPTIMIZERS = ("muon", "adafactor")

# precision -> (param_bytes, grad_bytes, fp32 master-copy bytes). In "fp32" the master copy is
# the parameter itself, so it costs nothing extra.
PRECISIONS: dict[str, tuple[int, int, int]] = {
    "mixed": (2, 2, 4),
    "fp32": (4, 4, 0),
}


def whole_tensor_shard_numel(shapes: Sequence[Sequence[int]], world_size: int) -> int:
    """Elements the fullest rank owns when each rank owns whole tensors (Muon, Adafactor), balanced
    greedily by size: at least ceil(Psi / N); the excess is the imbalance that the table's Psi/N
    does not show (the optimizer state scales with it; at stages 1-2 so do the padded shards and
    collectives; stage 3 balances its unpadded shards across units, to about the same bound)."""
    from ...shard.flat.whole_tensor_layout import WholeTensorLayout

    return WholeTensorLayout.of(shapes, world_size).shard_numel


def precision_bytes(precision: str, optimizer: str = "adam") -> tuple[int, int, int]:
    """(param_bytes, grad_bytes, K) per parameter; K counts optimizer states and master copy."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected {sorted(OPTIMIZER_STATES)}")
    param_bytes, grad_bytes, master_bytes = PRECISIONS[precision]
    return param_bytes, grad_bytes, master_bytes + 4 * OPTIMIZER_STATES[optimizer]


def max_model_numel(
    budget_bytes: float,
    world_size: int,
    stage: int,
    *,
    param_bytes: int,
    grad_bytes: int,
    optimizer_bytes: float,
) -> float:
    """Largest Psi whose model states fit ``budget_bytes`` per rank (the paper's Table 2)."""
    per_param = predict_model_state_bytes(
        1, world_size, stage, param_bytes=param_bytes, grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
    ).total
    return budget_bytes / per_param


# ---------------------------------------------------------------------------------------------
# The paper's Table 1: per-device GB of mixed-precision Adam (K=12) by DP degree.


@dataclass(frozen=True)
class PaperTableRow:
    """One row of Table 1: per-device model-state GB (1e9 bytes) at DP degree ``world_size``."""

    world_size: int
    os_gb: float  # P_os, stage 1
    os_g_gb: float  # P_os+g, stage 2
    os_g_p_gb: float  # P_os+g+p, stage 3


def paper_table(params: float, world_sizes: Sequence[int]) -> list[PaperTableRow]:
    """Table 1 for a model of ``params`` parameters (the DP=1 row is the unsharded baseline)."""
    p, g, k = precision_bytes("mixed", "adam")
    rows = []
    for n in world_sizes:
        gb = [
            predict_model_state_bytes(
                int(params), n, stage, param_bytes=p, grad_bytes=g, optimizer_bytes=k
            ).total / GB
            for stage in (1, 2, 3)
        ]
        rows.append(PaperTableRow(n, *gb))
    return rows


def paper_round(value: float) -> str:
    """Format a GB value the way the paper's Table 1 prints it.

    The rule that reproduces every printed cell: values >= 100 are truncated to an integer
    (513.5 -> "513", 4187.5 -> "4187"); smaller values are rounded half-up to 3 significant
    digits but at most 2 decimals (41.25 -> "41.3", 1.875 -> "1.88", 0.46875 -> "0.47",
    0.1171875 -> "0.12"); trailing zeros are dropped (30.0 -> "30").
    """
    x = Fraction(value)
    if x >= 100:
        return str(math.floor(x))
    if x == 0:
        return "0"
    decimals = min(2, 2 - math.floor(math.log10(value)))
    scaled = math.floor(x * 10**decimals + Fraction(1, 2))
    text = f"{scaled / 10**decimals:.{decimals}f}" if decimals > 0 else str(scaled)
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_param_count(params: float) -> str:
    """7.5e9 -> "7.5B", 1e12 -> "1T", 3.25e6 -> "3.25M"."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if params >= scale:
            return f"{params / scale:.3g}{unit}"
    return f"{params:.0f}"


def render_paper_table(params: Sequence[float], world_sizes: Sequence[int]) -> str:
    """Table 1 as Markdown text: one row per DP degree, three stage columns per model size."""
    header = ["DP"]
    for psi in params:
        name = format_param_count(psi)
        header += [f"{name} Pos", f"{name} Pos+g", f"{name} Pos+g+p"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    tables = [paper_table(psi, world_sizes) for psi in params]
    for i, n in enumerate(world_sizes):
        cells = [str(n)]
        for table in tables:
            row = table[i]
            cells += [paper_round(row.os_gb), paper_round(row.os_g_gb), paper_round(row.os_g_p_gb)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The bundled GPT (zerodp.tools.models.gpt): parameter count and activation memory.


class GPTShape(Protocol):
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    tie_embeddings: bool


def estimate_model_numel(cfg: GPTShape) -> int:
    """Parameter elements of ``GPT(cfg)``, a tied embedding counted once.

    Per block: qkv 3C^2 and proj C^2 (no biases), MLP 8C^2 + 5C, two LayerNorms 4C.
    """
    c = cfg.n_embd
    per_block = 12 * c * c + 9 * c
    embeddings = cfg.vocab_size * c + cfg.block_size * c
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * c
    return embeddings + cfg.n_layer * per_block + 2 * c + head


def estimate_activation_bytes(
    cfg: GPTShape, micro_batch: int, seq_len: int, dtype_bytes: int, checkpointing: bool = False
) -> float:
    """Bytes saved for backward by one forward of the bundled GPT (plus its ``lm_loss``).

    Assumptions, per block, with B=micro_batch, T=seq_len, C=n_embd, H=n_head:
      - tensors of ``dtype_bytes`` per element: the inputs of ln_1 and ln_2 (BTC each), their
        outputs (the qkv and fc inputs, BTC each), the qkv output that attention saves as q, k, v
        (3BTC), the attention output (the proj input, BTC), the fc output (GELU's input, 4BTC)
        and the GELU output (the MLP proj input, 4BTC): 16 BTC in all;
      - fp32 statistics: LayerNorm mean and rstd (2 x 2BT) and the attention logsumexp (BHT);
      - attention through a fused SDPA kernel, so no T x T matrix is saved (the math fallback,
        used e.g. with attention dropout on some backends, would add B*H*T^2 terms);
      - dropout off (p=0 saves no masks).
    Outside the blocks: the token ids and targets (int64, BT each), the positions (T, int64),
    ln_f's input, output and statistics, and the fp32 log-probabilities of the loss (BTV * 4:
    ``lm_loss`` upcasts the logits). Parameters are model states and are not counted.

    With ``checkpointing`` (each block wrapped in activation checkpointing) only the block
    inputs are kept (BTC per block), plus one block's full activations live while it is
    recomputed during backward.
    """
    b, t, c, d = micro_batch, seq_len, cfg.n_embd, dtype_bytes
    btc = b * t * c
    block = 16 * btc * d + 2 * 2 * b * t * 4 + b * cfg.n_head * t * 4
    outside = (2 * b * t + t) * 8 + 2 * btc * d + 2 * b * t * 4 + b * t * cfg.vocab_size * 4
    if checkpointing:
        return cfg.n_layer * btc * d + block + outside
    return cfg.n_layer * block + outside


def format_bytes(n: float) -> str:
    """Human-readable binary size: 512 -> "512 B", 3 * 2**20 -> "3.00 MiB"."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.2f} {unit}"
    raise AssertionError("unreachable")
