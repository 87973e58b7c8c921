"""Activation memory of the bundled GPT per rank, with and without ZeRO-R (the paper's section 6.1).

Per micro-batch of B sequences of T tokens, width C, L blocks, d bytes per element:

    no checkpointing      every block's saved activations, L * A_block (formulas.estimate_activation_bytes)
    checkpointing         the L block inputs, L * B*T*C*d, plus one block's A_block while it is
                          recomputed in backward
    + Pa (TP ranks)       each block input split across the tensor-parallel group:
                          L * ceil(B*T*C / TP) * d per rank, all-gathered one at a time in backward
    + cpu                 the kept inputs in host memory: nothing of them on the device
                          (L * B*T*C*d, or / TP with Pa, of host memory instead)

The activations outside the blocks (embeddings, final LayerNorm, the loss's fp32 log-probabilities)
are the same in every row. The ZeRO paper gives the same accounting: checkpoints cost one B*T*C
per layer (B*T*C*d*L in all), Pa divides them by the model-parallel degree, and Pa+cpu leaves
almost nothing of them on the device.

`tensor_parallel=t` describes the Megatron-style GPT (models/tp_gpt.py) on t ranks: of a block's
16 B*T*C saved elements, the LayerNorms' inputs and outputs (4 B*T*C) stay whole on every rank and
the attention and MLP interiors (12 B*T*C) are split, as are the attention statistics (H/t heads)
and the loss's log-probabilities (vocab-parallel, V/t per rank): A_block = (4 + 12/t) B*T*C*d + ...
The block inputs that checkpointing keeps are replicated on the t ranks, which is what Pa removes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .formulas import GPTShape, estimate_activation_bytes, format_bytes


@dataclass(frozen=True)
class ActivationMemory:
    """One rank's activation bytes for one micro-batch, at their peak (start of backward)."""

    kept_device: float  # kept for backward on the device: saved activations, or checkpoints
    kept_host: float    # checkpoints offloaded to host memory (cpu_checkpointing)
    working: float      # recomputed block (with checkpointing) and the activations outside the blocks

    @property
    def device(self) -> float:
        return self.kept_device + self.working


def activation_memory(cfg: GPTShape, micro_batch: int, seq_len: int, dtype_bytes: int, *,
                      checkpointing: bool = False, partition_degree: int = 1,
                      cpu_checkpointing: bool = False, tensor_parallel: int = 1) -> ActivationMemory:
    """Peak activation bytes per rank of the bundled GPT, or of the tensor-parallel one on `tensor_parallel`
    ranks (module docstring); Pa (`partition_degree`) and cpu need checkpointing."""
    if partition_degree < 1 or tensor_parallel < 1 or cfg.n_head % tensor_parallel:
        raise ValueError(f"partition_degree ({partition_degree}) and tensor_parallel ({tensor_parallel}) must be at "
                         f"least 1, and tensor_parallel must divide n_head ({cfg.n_head})")
    if not checkpointing and (partition_degree > 1 or cpu_checkpointing):
        raise ValueError("partition_activations and cpu_checkpointing act on activation checkpointing: "
                         "switch checkpointing on")
    outside = estimate_activation_bytes(dataclasses.replace(cfg, n_layer=0), micro_batch, seq_len, dtype_bytes)
    block = estimate_activation_bytes(dataclasses.replace(cfg, n_layer=1), micro_batch, seq_len, dtype_bytes) - outside
    if tensor_parallel > 1:
        btc, bt, t = micro_batch * seq_len * cfg.n_embd, micro_batch * seq_len, tensor_parallel
        block -= (12 * btc * dtype_bytes + cfg.n_head * bt * 4) * (1 - 1 / t)  # interiors and heads split
        outside -= bt * cfg.vocab_size * 4 * (1 - 1 / t)  # vocab-parallel log-probabilities
    if not checkpointing:
        return ActivationMemory(cfg.n_layer * block, 0.0, outside)
    btc = micro_batch * seq_len * cfg.n_embd
    kept = cfg.n_layer * -(-btc // partition_degree) * dtype_bytes
    if cpu_checkpointing:
        return ActivationMemory(0.0, kept, block + outside)
    return ActivationMemory(kept, 0.0, block + outside)


def activation_rows(cfg: GPTShape, micro_batch: int, seq_len: int, dtype_bytes: int,
                    tp: int) -> list[tuple[str, ActivationMemory]]:
    """The settings `zerodp estimate --model` prints: off, on, +cpu, +Pa at `tp`, +Pa+cpu."""
    def row(**keys) -> ActivationMemory:
        return activation_memory(cfg, micro_batch, seq_len, dtype_bytes, **keys)

    return [("no checkpointing", row()),
            ("checkpointing (each block)", row(checkpointing=True)),
            ("+ cpu_checkpointing", row(checkpointing=True, cpu_checkpointing=True)),
            (f"+ partition_activations (Pa, TP={tp})", row(checkpointing=True, partition_degree=tp)),
            (f"+ Pa + cpu (TP={tp})", row(checkpointing=True, partition_degree=tp, cpu_checkpointing=True))]


def render_activation_table(cfg: GPTShape, micro_batch: int, seq_len: int, dtype_bytes: int, tp: int) -> str:
    """Markdown table of `activation_rows`: device peak, of which kept, and host bytes per rank."""
    lines = [f"activations per rank, one micro-batch of {micro_batch} x {seq_len} tokens, {dtype_bytes}-byte "
             f"elements (ZeRO-R, docs/activations.md):",
             "| setting | device peak | kept on device | working | host |", "|---|---|---|---|---|"]
    for name, mem in activation_rows(cfg, micro_batch, seq_len, dtype_bytes, tp):
        lines.append(f"| {name} | {format_bytes(mem.device)} | {format_bytes(mem.kept_device)} | "
                     f"{format_bytes(mem.working)} | {format_bytes(mem.kept_host)} |")
    return "\n".join(lines)
