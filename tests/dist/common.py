"""Shared pieces of the multi-rank tests: a parity model, deterministic data, and the plain-PyTorch
reference that every zerodp run is compared against (one process, the global batch)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp

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


def assert_adam_params_close(params: dict, ref_params: dict, lr: float, steps: int, where: str = "") -> None:
    """Parameters trained by Adam(W) for `steps` steps at `lr` equal the reference's, at the scale Adam moves them.

    Why this scale and not each element's: Adam moves an element by about lr per step whatever its
    gradient's size (m_hat / sqrt(v_hat) is ~1), and summation order across ranks changes a gradient by
    ~1e-7 of the *tensor's* largest gradient. An element whose own gradient is that small (a LoRA B
    column, a nearly unused embedding row) gets a normalized update that differs by a visible fraction
    of lr: 4e-6 after 3 steps at lr 1e-2 was seen here (1.3e-4 of lr * steps), and a pure relative
    tolerance on that element's value (e.g. 1e-5 of 0.014) fails by luck of the draw. So the bound is
    1e-3 of the largest movement lr * steps (3e-5 at lr 1e-2, 3 steps), plus rtol 1e-5 of the value for
    the fp32 rounding of large weights: an update wrong by 1e-4 in one element still fails
    (tests/dist/test_hf_stage3.py checks that it does).
    """
    atol = 1e-3 * lr * steps
    for key, ref in ref_params.items():
        torch.testing.assert_close(params[key], ref, rtol=1e-5, atol=atol,
                                   msg=lambda m: f"{where}: {key} differs beyond 1e-3 of lr * steps: {m}")


def assert_matches_reference(rank: int, losses, params: dict, ref_losses, ref_params: dict, what: str = "") -> None:
    """One rank's losses and parameters equal the plain-PyTorch reference's, up to fp32 summation order.

    Losses: rtol 1e-5 (a mean loss of order 1, summed in another order: ~1e-7 relative, x100 margin for
    the steps it has been through). Parameters: rtol 1e-5, and atol 1e-6 for values near zero: these
    models' weights are of order 0.1-1 and summation order changes them by ~1e-7 of that scale per step,
    so the absolute term is relative to the tensor's scale, not each element's. A wrong update of 1e-4
    in one element fails. `what` names the case."""
    where = f"rank {rank}{' ' + what if what else ''}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                               msg=lambda m: f"{where}: losses differ: {m}")
    for key, ref in ref_params.items():
        torch.testing.assert_close(params[key], ref, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{where}: {key} differs: {m}")


def assert_trained(ref_params: dict, init: dict, by: float = 1e-2) -> None:
    """The reference moved some parameter by more than `by`: the comparison is not between two
    untrained models."""
    assert max((ref_params[k] - init[k]).abs().max().item() for k in init) > by, "the reference did not train"


def reference_run(opt_name: str, steps: int, rows: int, clip: float) -> tuple[list[float], dict]:
    """Plain PyTorch, one process, the global batch: the losses of each step and the final params."""
    model = make_model()
    opt = make_optimizer(opt_name, model)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, rows)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


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


class _Params:
    """Stands in for a model where only `.parameters()` is needed (building param groups)."""

    def __init__(self, params: list) -> None:
        self._params = params

    def parameters(self):
        return iter(self._params)


def mixed_precision_reference(model: nn.Module, optimizer_for, batches, loss_fn, clip: float,
                              loss_scale: float = 1.0) -> tuple[list[float], dict]:
    """Plain PyTorch mixed precision on the global batch: `model` (already in the low precision)
    computes, `optimizer_for(params)` steps fp32 master copies of its parameters, the loss is scaled by
    a static `loss_scale` and unscaled before clipping. `batches` yields (x, y) in the model's dtype;
    `loss_fn(output, y, model)` returns the loss."""
    masters = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in model.parameters()]
    opt = optimizer_for(_Params(masters))  # same groups, built over the fp32 masters
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y, model)
        (loss * loss_scale).backward()
        for p, m in zip(model.parameters(), masters):
            m.grad = None if p.grad is None else p.grad.float() / loss_scale
        if clip:
            torch.nn.utils.clip_grad_norm_([m for m in masters if m.grad is not None], clip)
        opt.step()
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
        losses.append(loss.item())
    return losses, {k: v.detach().float().clone() for k, v in model.state_dict().items()}


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
