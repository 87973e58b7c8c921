"""Pieces of the whole-tensor optimizer tests (Muon + AdamW, Adafactor): a tiny tied-embedding GPT,
its data, the optimizers, and the oracle's reference run of them."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerodp
from zerodp.tools.models.gpt import GPT, GPTConfig, lm_loss
from tests.oracle import train_reference

# Tiny, tied, bias-free attention (STYLE.md: no parameter with an exactly-zero true gradient).
# Odd widths so that whole-tensor shards are unequal and need padding at world sizes 2 and 3.
GPT_CONFIG = GPTConfig(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=14, tie_embeddings=True)
SEQ, GAS, CLIP, GLOBAL_ROWS = 8, 2, 0.5, 12  # 12 rows: micro batches of 3 at world 2, of 2 at world 3


def make_gpt(seed: int = 0) -> GPT:
    return GPT(GPT_CONFIG, seed=seed)


def newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """Muon's quintic Newton-Schulz orthogonalisation in fp32 (torch's runs it in bf16)."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class MuonFP32(torch.optim.Muon):
    """torch's Muon with its orthogonalisation in fp32, so that parity can be checked at fp32's
    tolerance (torch's bf16 rounding turns 1e-7 summation-order noise into 1e-3 jumps). Not in
    zerodp's list: registered through `zerodp.optim.register_whole_tensor`, as a user would."""

    @torch.no_grad()
    def step(self, closure=None):
        import torch.optim._muon as muon_module

        saved = muon_module._zeropower_via_newtonschulz
        muon_module._zeropower_via_newtonschulz = newton_schulz_fp32
        try:
            return super().step(closure)
        finally:
            muon_module._zeropower_via_newtonschulz = saved


def is_muon_param(name: str, p) -> bool:
    """Muon on the blocks' matrices; embeddings (tied head), norms and biases go to AdamW."""
    return p.dim() == 2 and name.startswith("blocks.")


def make_optimizers(name: str, model):
    named = list(model.named_parameters())
    if name in ("muon", "muon_fp32"):
        cls = MuonFP32 if name == "muon_fp32" else torch.optim.Muon
        matrices = [p for n, p in named if is_muon_param(n, p)]
        rest = [p for n, p in named if not is_muon_param(n, p)]
        # The cubic Newton-Schulz coefficients (1.5, -0.5, 0) converge; torch's default quintic ones
        # amplify small singular directions ~450x over 5 steps, and with them 1e-7 summation-order noise
        # in the gradient (two correct implementations) reaches 1e-6 in the weights.
        ns = {"ns_coefficients": (1.5, -0.5, 0.0)} if name == "muon_fp32" else {}
        return [cls(matrices, lr=0.05, weight_decay=0.01, momentum=0.9, **ns),
                torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.01)]
    if name == "adafactor":
        return torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.01)
    raise ValueError(name)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, GPT_CONFIG.vocab_size, (GLOBAL_ROWS, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference_run(name: str, steps: int) -> tuple[list[float], dict]:
    """The oracle (tests/oracle.py) on this model and data: losses and final parameters."""
    def step_loss(model, step: int) -> torch.Tensor:
        x, y = global_batch(step)
        return lm_loss(model(x), y)

    model = make_gpt()
    ref = train_reference(model, make_optimizers(name, model), steps, step_loss, clip=CLIP)
    return ref.losses, ref.params


def config(stage: int, world: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": GLOBAL_ROWS // (world * GAS), "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP,
            # stage 3: one unit per block and vectors sharded too (no persistence threshold)
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}


def train(engine, first_step: int, steps: int) -> list[float]:
    """Optimizer steps [first_step, first_step + steps) on this rank's rows; global-mean losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro_bs = engine.micro_batch_size
    losses = []
    for step in range(first_step, first_step + steps):
        x, y = global_batch(step)
        total = torch.zeros(1)
        for micro in range(GAS):
            lo = (micro * world + rank) * micro_bs
            loss = lm_loss(engine(x[lo:lo + micro_bs]), y[lo:lo + micro_bs])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (world * GAS))
    return losses


def register() -> None:
    zerodp.optim.register_whole_tensor(MuonFP32)
