"""Bytes alive at the optimizer step's peak, bf16 at world 1, counted on the CPU (issue 32's extra 4 bytes per parameter).

    python -m bench.step_memory          # writes bench/results/step_memory.md

A small GPT (8 blocks, each its own unit at stage 3) trains two bf16 steps; during the second, the
storages of every live CPU tensor are summed just before the inner optimizer steps (the moment the
fp32 gradients are bound), and compared with the sum just before `engine.step()`. The difference is
what the step adds on top of the model states: with every unit's fp32 gradient copy made at once
(zerodp before [Note: fp32 gradients at the step], optim/transient_grads.py) it is 4 bytes per
parameter; made per window, 4 bytes per element of the largest window.
"""

from __future__ import annotations

import gc
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import zerodp
from zerodp.tools.models.gpt import GPT, GPTConfig
from zerodp.optim import optimizer as optimizer_module

ROOT = Path(__file__).resolve().parents[1]
CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=8, n_head=4, n_embd=64)


def live_cpu_bytes() -> int:
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):
            try:
                s = obj.untyped_storage()
            except Exception:  # a stage-3 parameter left by another engine refuses reads outside a gather
                continue
            if s.device.type == "cpu" and s.nbytes():
                storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def measure(stage: int, windowed: bool) -> tuple[float, float, int]:
    """(bytes per parameter before the step, bytes per parameter the step adds at its peak, parameters)."""
    original = optimizer_module.transient_grads_apply
    if not windowed:
        optimizer_module.transient_grads_apply = lambda opt: False
    try:
        torch.manual_seed(0)
        model = GPT(CFG)
        numel = sum(p.numel() for p in model.parameters())
        zero = {"stage": stage, **({"stage3_unit_modules": ["Block"]} if stage == 3 else {})}
        engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   {"bf16": {"enabled": True}, "zero_optimization": zero})
        inner, peak = engine.optimizer.optimizer, [0]
        step = inner.step

        def counted(*args, **kwargs):
            peak[0] = max(peak[0], live_cpu_bytes())
            return step(*args, **kwargs)
        inner.step = counted
        for i in range(2):
            x = torch.randint(256, (2, 33), generator=torch.Generator().manual_seed(i))
            loss = F.cross_entropy(engine(x[:, :-1]).float().reshape(-1, 256), x[:, 1:].reshape(-1))
            engine.backward(loss)
            gc.collect()
            before, peak[0] = live_cpu_bytes(), 0
            engine.step()
        engine.close()
        return before / numel, (peak[0] - before) / numel, numel
    finally:
        optimizer_module.transient_grads_apply = original


def main() -> None:
    torch.set_num_threads(1)
    lines = ["| stage | fp32 gradients | bytes/param before the step | added at the step's peak |", "|---|---|---|---|"]
    numel = 0
    for stage in (1, 2, 3):
        for windowed in (False, True):
            before, added, numel = measure(stage, windowed)
            lines.append(f"| {stage} | {'per window' if windowed else 'all at once'} | {before:.2f} | {added:.2f} |")
    text = (f"# Bytes at the optimizer step's peak (issue 32)\n\nCommand: `python -m bench.step_memory "
            f"{' '.join(shlex.quote(a) for a in sys.argv[1:])}`; GPT 8 x 64 ({numel} parameters), bf16, AdamW, "
            f"world 1 on the CPU, live tensor storages summed (bench/step_memory.py). Stages 1-2 keep one bucket "
            f"for this small model, so their window is the whole shard.\n\n" + "\n".join(lines) + "\n")
    out = ROOT / "bench" / "results" / "step_memory.md"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
