"""Shared pieces of the multi-rank tests: a parity model, deterministic data, and zerodp runs of it. The
plain-PyTorch reference they are compared against, and the tolerances, are the oracle's (tests/oracle.py);
its names are re-exported here for the tests written against this module."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp

from ..oracle import (_Params, assert_adam_params_close, assert_matches_reference, assert_trained,  # noqa: F401 (re-exported)
                      mixed_precision_reference, train_reference)

IN, HID, OUT = 12, 23, 5  # odd sizes so that flat buffers need padding at world sizes 2 and 3


class ParityNet(nn.Module):
    """Covers the awkward cases: a frozen layer, a parameter that never gets a gradient, a 1-D
    parameter, and weights/biases in different param groups."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HID)
        self.frozen = nn.Linear(HID, HID)
        self.frozen.requires_grad_(False)
        self.gain = nn.Parameter(torch.ones(HID))
        self.hidden = nn.Linear(HID, HID)
        self.out = nn.Linear(HID, OUT)
        self.unused = nn.Linear(HID, 3)  # never called: its .grad stays None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.frozen(h)) * self.gain
        h = torch.tanh(self.hidden(h))
        return self.out(h)


def make_model(seed: int = 0) -> ParityNet:
    torch.manual_seed(seed)
    return ParityNet()


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices with weight decay, vectors (biases, gains) without."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(name: str, model: nn.Module):
    if name == "sgd":
        return torch.optim.SGD(param_groups(model, 1e-2), lr=0.05, momentum=0.9, nesterov=True)
    if name == "adamw":
        return torch.optim.AdamW(param_groups(model, 1e-2), lr=1e-2)
    if name == "adamw_fused":  # torch's fused CPU kernel: its own arithmetic, which zerodp must keep
        return torch.optim.AdamW(param_groups(model, 1e-2), lr=1e-2, fused=True)
    if name == "larc":
        return zerodp.optim.LARC(torch.optim.SGD(param_groups(model, 1e-3), lr=0.1, momentum=0.9),
                                 trust_coefficient=0.02, clip=True)
    if name == "lamb":
        return zerodp.optim.LAMB(param_groups(model, 1e-2), lr=1e-2)
    raise ValueError(name)


_TEACHER = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(7))


def global_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh inputs each step; targets from a fixed teacher plus noise, so the loss can fall."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows, IN, generator=g)
    y = torch.tanh(x @ _TEACHER) + 0.05 * torch.randn(rows, OUT, generator=g)
    return x, y


def micro_batch(step: int, micro: int, rank: int, world: int, micro_bs: int, gas: int):
    """Rank `rank`'s rows of micro-step `micro`: the global batch split by micro-step, then by rank."""
    x, y = global_batch(step, micro_bs * world * gas)
    lo = (micro * world + rank) * micro_bs
    return x[lo:lo + micro_bs], y[lo:lo + micro_bs]


def reference_run(opt_name: str, steps: int, rows: int, clip: float) -> tuple[list[float], dict]:
    """The oracle (tests/oracle.py) on the parity model and data: the losses of each step and the final params."""
    def step_loss(model: nn.Module, step: int) -> torch.Tensor:
        x, y = global_batch(step, rows)
        return F.mse_loss(model(x), y)

    model = make_model()
    ref = train_reference(model, make_optimizer(opt_name, model), steps, step_loss, clip=clip)
    return ref.losses, ref.params


def zerodp_run(config: dict, opt_name: str, steps: int, micro_bs: int) -> tuple[list[float], dict]:
    """Train with zerodp on this rank; returns the global-mean loss of each step and the final params."""
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer(opt_name, model), config)
    losses = train_steps(engine, steps, micro_bs)
    with zerodp.gathered_parameters(model.parameters()):  # stage 3: full values; other stages: as they are
        return losses, {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def train_steps(engine, steps: int, micro_bs: int, first_step: int = 0, noise: bool = False) -> list[float]:
    """Run optimizer steps [first_step, first_step + steps) on this rank's micro-batches; returns the
    global-mean loss of each. With `noise`, inputs get noise from the global RNG (so an exact resume
    also needs the RNG states restored)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gas = engine.gradient_accumulation_steps
    losses = []
    for step in range(first_step, first_step + steps):
        total = torch.zeros(1)
        for micro in range(gas):
            x, y = micro_batch(step, micro, rank, world, micro_bs, gas)
            if noise:
                x = x + 0.1 * torch.randn_like(x)
            loss = F.mse_loss(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (world * gas))
    return losses


def reference_mixed_run(dtype: torch.dtype, opt_name: str, steps: int, rows: int, clip: float,
                        loss_scale: float = 1.0) -> tuple[list[float], dict]:
    """`mixed_precision_reference` for the parity model and data of this module."""
    batches = ((x.to(dtype), y) for x, y in (global_batch(step, rows) for step in range(steps)))
    return mixed_precision_reference(make_model().to(dtype), lambda params: make_optimizer(opt_name, params),
                                     batches, lambda out, y, model: F.mse_loss(out.float(), y), clip, loss_scale)


@contextlib.contextmanager
def optimizer_chunks(numel: int):
    """Make the sharded optimizer step chunks of `numel` elements (real models use 1 MiB chunks,
    more than these test models hold), so that chunks cut across parameters and shards."""
    import zerodp.optimizer as zopt

    saved, zopt.OPTIMIZER_CHUNK_NUMEL = zopt.OPTIMIZER_CHUNK_NUMEL, numel
    try:
        yield
    finally:
        zopt.OPTIMIZER_CHUNK_NUMEL = saved


def zerodp_run_chunked(chunk_numel: int, *args) -> tuple[list[float], dict]:
    """`zerodp_run` with the optimizer stepping chunks of `chunk_numel` elements."""
    with optimizer_chunks(chunk_numel):
        return zerodp_run(*args)


def train_own_tokens(engine, steps, batch, micro_bs: int, check=None) -> list[float]:
    """A causal LM (Hugging Face's `labels=` loss) trained on this rank's own rows of each step's global batch
    `batch(step, rows)`; `steps`: an int or a range; `check(step)` after each step. Returns the global mean losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps) if isinstance(steps, int) else steps:
        ids = batch(step, micro_bs * world)[rank * micro_bs:(rank + 1) * micro_bs]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if check is not None:
            check(step)
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses
