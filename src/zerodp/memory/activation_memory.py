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
almost nothing of them on the device. A block's working activations in a tensor-parallel model
would be split by TP too (its attention and MLP interiors); the bundled GPT's block is not
tensor-parallel, so A_block is whole here.
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
                      cpu_checkpointing: bool = False) -> ActivationMemory:
    """Peak activation bytes per rank of the bundled GPT (module docstring); Pa and cpu need checkpointing."""
    if partition_degree < 1:
        raise ValueError(f"partition_degree must be at least 1, got {partition_degree}")
    if not checkpointing and (partition_degree > 1 or cpu_checkpointing):
        raise ValueError("partition_activations and cpu_checkpointing act on activation checkpoints: "
                         "switch checkpointing on")
    outside = estimate_activation_bytes(dataclasses.replace(cfg, n_layer=0), micro_batch, seq_len, dtype_bytes)
    block = estimate_activation_bytes(dataclasses.replace(cfg, n_layer=1), micro_batch, seq_len, dtype_bytes) - outside
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
