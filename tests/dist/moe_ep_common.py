"""Shared pieces of the expert-parallel MoE tests: a tiny MoE model, its expert-parallel copy, and the
single-process reference holding every expert.

The reference is the same model with ep_size=1 in one process, fed the global batch as the ranks' chunks
(micro-step, then rank), each chunk gated on its own (the gate's capacity and load-balancing loss are
per rank's tokens, as on the ranks), the loss the mean over the chunks: this is the single-process model
the distributed run must equal. An expert no chunk routed a token to gets no gradient (None), so AdamW
skips it, as torch does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp
from zerodp.moe import MoE
from tests.dist.common import IN, OUT, make_optimizer, micro_batch
from tests.oracle import train_reference

HID = 10
NUM_EXPERTS = 8
AUX_WEIGHT = 0.1  # the load-balancing loss joins the task loss, so the gate's gradient carries it


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(HID, 2 * HID)
        self.w2 = nn.Linear(2 * HID, HID)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class MoENet(nn.Module):
    def __init__(self, ep_size: int, **moe_options) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HID)
        self.moe = MoE(HID, Expert(), num_experts=NUM_EXPERTS, ep_size=ep_size, **moe_options)
        self.out = nn.Linear(HID, OUT)

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        m, l_aux, _ = self.moe(h)
        return self.out(h + m), l_aux


def full_model(second_half_unreachable: bool = False, **moe_options) -> MoENet:
    """The single-process model: every expert, each with its own weights; a gate sharp enough that some
    experts get no token on some steps. `second_half_unreachable`: the gate's rows of experts E/2.. are copies
    of expert 0's, so at the first step they never win (argmax takes the first of equal values)."""
    torch.manual_seed(0)
    model = MoENet(1, **moe_options)
    with torch.no_grad():
        for g, expert in enumerate(model.moe.moe.experts):
            gen = torch.Generator().manual_seed(100 + g)
            for p in expert.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        wg = model.moe.moe.gate.wg.weight
        wg.mul_(6.0)
        if second_half_unreachable:
            wg[NUM_EXPERTS // 2:] = wg[0]
    return model


def expert_key(key: str, ep_rank: int, num_local: int) -> str:
    """A local expert's state-dict key under the single-process model's name (its global expert index)."""
    marker = "moe.moe.experts."
    if not key.startswith(marker):
        return key
    local, rest = key[len(marker):].split(".", 1)
    return f"{marker}{ep_rank * num_local + int(local)}.{rest}"


def ep_model(ep_size: int, ep_rank: int, second_half_unreachable: bool = False, **moe_options) -> MoENet:
    """The expert-parallel copy of `full_model` for expert-parallel rank `ep_rank`: its experts are the global ones."""
    full = full_model(second_half_unreachable, **moe_options).state_dict()
    model = MoENet(ep_size, **moe_options)
    num_local = NUM_EXPERTS // ep_size
    model.load_state_dict({k: full[expert_key(k, ep_rank, num_local)] for k in model.state_dict()})
    return model


def loss_of(model, x, y):
    out, l_aux = model(x)
    return F.mse_loss(out.float(), y) + AUX_WEIGHT * l_aux.float()  # .float(): a no-op in fp32; bf16 runs


class _Chunks(nn.Module):
    """The model run on each rank's chunk of the global batch, each gated on its own (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, chunks):
        return [self.model(x) for x in chunks]


def mixed_reference_run(dtype: torch.dtype, optimizer: str, steps: int, world: int, micro_bs: int, clip: float,
                        loss_scale: float = 1.0, **moe_options):
    """`mixed_precision_reference` (tests/oracle.py) for the single-process MoE model in `dtype`: losses and
    parameters (the low-precision model's, as fp32) after `steps` steps on the ranks' chunks."""
    from tests.oracle import mixed_precision_reference

    def loss_fn(outs, ys, _model):
        return torch.stack([F.mse_loss(out.float(), y) + AUX_WEIGHT * l_aux.float()
                            for (out, l_aux), y in zip(outs, ys)]).mean()

    chunks = ([micro_batch(step, 0, rank, world, micro_bs, 1) for rank in range(world)] for step in range(steps))
    batches = (([x.to(dtype) for x, _ in c], [y for _, y in c]) for c in chunks)
    model = _Chunks(full_model(**moe_options).to(dtype))
    losses, params = mixed_precision_reference(model, lambda m: make_optimizer(optimizer, m), batches, loss_fn, clip,
                                               loss_scale)
    return losses, {k.removeprefix("model."): v for k, v in params.items()}


def reference_run(steps: int, world: int, micro_bs: int, gas: int, clip: float, **moe_options):
    """Losses, final parameters, per step the experts that got no gradient (module docstring), and per step the
    gradient norm before clipping."""
    unused = []

    def step_loss(model, step: int) -> torch.Tensor:
        chunks = [loss_of(model, *micro_batch(step, micro, rank, world, micro_bs, gas))
                  for micro in range(gas) for rank in range(world)]
        return torch.stack(chunks).mean()

    def note_unused(model, step: int) -> None:
        unused.append([g for g, e in enumerate(model.moe.moe.experts) if e.w1.weight.grad is None])

    model = full_model(**moe_options)
    # clip inf when not clipping: the norm is still recorded, nothing is scaled
    ref = train_reference(model, make_optimizer("adamw", model), steps, step_loss, clip=clip or float("inf"),
                          after_backward=note_unused)
    return ref.losses, ref.params, unused, ref.grad_norms


def zerodp_run(config: dict, ep_size: int, steps: int, micro_bs: int, optimizer: str = "adamw", **moe_options):
    """This rank's global-mean losses and its parameters under the single-process model's names."""
    rank = dist.get_rank()
    ep_rank = rank % ep_size  # consecutive expert-parallel groups: {0..P-1}, {P..2P-1}, ...
    model = ep_model(ep_size, ep_rank, **moe_options)
    engine = zerodp.initialize(model, make_optimizer(optimizer, model), config)
    try:
        losses = train(engine, 0, steps, micro_bs)
        num_local = NUM_EXPERTS // ep_size
        with zerodp.gathered_parameters(model.parameters()):  # stage 3: full values; other stages: as they are
            params = {expert_key(k, ep_rank, num_local): v.detach().clone() for k, v in model.state_dict().items()}
        full = engine.full_state_dict(rank0_only=False)  # the single-process model's, every expert (moe/consolidate.py)
        # stage 3: dense units split over the ranks (the experts' buckets are whole per rank, sharded over the
        # expert-data-parallel group); parameters are read whole above (gathered_parameters)
        partitioned = any(type(u).__name__ == "FlatUnit" and not u.persistent for u in engine.units)
        return losses, params, engine.grad_norm, full, partitioned
    finally:
        engine.close()


def refusals_run(micro_bs: int) -> list[str]:
    """What is not implemented yet says so, at initialize: offload_param with expert parallelism."""
    import pytest

    rank = dist.get_rank()
    model = ep_model(2, rank % 2)
    with pytest.raises(zerodp.ConfigError, match="offload_param with expert-parallel MoE layers"):
        zerodp.initialize(model, make_optimizer("adamw", model), {"train_micro_batch_size_per_gpu": micro_bs,
                                                                    "zero_optimization": {"stage": 3, "offload_param":
                                                                                          {"device": "cpu"}}})
    return ["offload_param"]


def train(engine, first_step: int, steps: int, micro_bs: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gas = engine.gradient_accumulation_steps
    losses = []
    for step in range(first_step, first_step + steps):
        total = torch.zeros(1)
        for micro in range(gas):
            loss = loss_of(engine, *micro_batch(step, micro, rank, world, micro_bs, gas))
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (world * gas))
    return losses


def resume_run(saved: tuple, resumed: tuple, steps: int, micro_bs: int, folder: str, **moe_options):
    """Train `steps` steps at (stage, ep_size) `saved`, save, load into a fresh engine at `resumed`, train `steps`
    more; the losses of both halves and the final single-process state dict."""
    rank = dist.get_rank()
    halves, full = [], None
    for half, (stage, ep_size) in enumerate((saved, resumed)):
        model = ep_model(ep_size, rank % ep_size, **moe_options)
        config = {"train_micro_batch_size_per_gpu": micro_bs, "gradient_clipping": 0.5,
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": 200,
                                        "stage3_param_persistence_threshold": 0}}
        engine = zerodp.initialize(model, make_optimizer("adamw", model), config)
        try:
            if half:
                assert engine.load_checkpoint(folder) == {"note": "kept"}
            halves.append(train(engine, half * steps, steps, micro_bs))
            if not half:
                engine.save_checkpoint(folder, client_state={"note": "kept"})
            else:
                full = engine.full_state_dict(rank0_only=False)
        finally:
            engine.close()
    return halves[0] + halves[1], full
