"""The parity oracle: plain single-process PyTorch on the global batch, and the tolerances zerodp is held to.

Every "exact" in zerodp's guarantees means: the same model, data and seed trained by `train_reference` (one
process, the whole global batch, torch's own optimizer, `torch.nn.utils.clip_grad_norm_`) and by zerodp on N
ranks give the same losses and the same final parameters within the tolerances below. The reference is written
once, here; a test supplies only what differs (its model, its optimizer, how a step's loss is computed).

Tolerances, justified once:
  FP32  rtol 1e-5 on losses and parameters, atol 1e-6 on parameters. zerodp sums gradients in another order
        (a reduce-scatter over ranks, buckets, flat shards) than one process does: ~1e-7 relative per step,
        x100 margin for the steps a test runs. The absolute term is for values near zero: these models'
        weights are of order 0.1-1, and summation order moves them by ~1e-7 of that scale, so it is relative
        to the tensor's scale, not each element's. A wrong update of 1e-4 in one element fails.
  ADAM  `assert_adam_params_close`: rtol 1e-5 plus atol 1e-3 * lr * steps. Adam moves an element by about lr
        per step whatever its gradient's size, so an element whose own gradient is tiny (a LoRA B column, a
        nearly unused embedding row) turns summation-order noise into a visible fraction of lr; the bound
        is relative to the largest movement Adam can make. An update wrong by 1e-4 still fails.
  BF16  mixed precision: `mixed_precision_reference` computes in the low precision and steps fp32 masters
        as zerodp does; tests state their ulp bounds where they compare (tests/dist/test_precision.py).

Features a reference may need, here rather than in a copy: accumulation (micro-batches divided by their count,
which also runs one forward per rank where a model's state is per rank: `RankBuffers` for BatchNorm's statistics,
per-rank RNG streams in tests/dist/tensor_parallel_common.py), a hook before each step (a schedule, a model switch)
and after each backward (norms), a `backward` that raises midway and skips its step (tests/dist/test_bucket_intake.py),
several optimizers over one model (tests/dist/whole_tensor_common.py).

Every single-process reference under tests/ is this module's; tests/unit/test_oracle.py fails when a function
under tests/ (DeepSpeed's own scripts apart) trains a loop of its own, outside its list of the few that are no
reference (a peer such as DDP or FSDP2 training on the ranks, a user's Accelerate loop, an optimizer given state
to be refused, a loss that must fall).
Kept apart, with the reason:
- Subprocess workers that cannot import this module: none keeps a reference. The scripts launched as a user
  launches them (tests/e2e/*_job.py, tests/e2e/deepspeed_script/, tests/e2e/deepspeed_scripts/ (DeepSpeed-Chat's
  and DeepSpeed's own scripts, kept as their authors wrote them), tests/hf/*_worker.py) hold a user's training
  loop, not a reference: the test compares them with the same script's plain run (Accelerate's DDP, the HF
  Trainer) or with this module run in the test process (tests/e2e/test_deepspeed_script.py). The workers that
  train a reference beside zerodp (tests/gpu/cuda_scripts.py) run with the repository on their path and call
  this module.
- tests/dist/test_larc_formula.py keeps its own step on purpose: it is LARC's formula written independently.
- tests/activation_regions.py drives both sides of the activation-checkpointing tests (plain regions and each
  checkpointing form) through one loop and compares gradients, the input's gradient and the RNG state, which a
  reference of losses and parameters does not record; it checks checkpointing, not zerodp's training.
- tests/fixtures/deepspeed_ckpt/loop.py is the training loop of DeepSpeed's engine (real DeepSpeed and zerodp's
  adapter run it on the ranks): no reference, the same loop on both sides of a checkpoint comparison.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, Iterator, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn


class Reference(NamedTuple):
    """What the reference run leaves: the loss of each step, the final state (fp32 clones), the gradient norm
    before clipping of each step (empty without clipping), and the model and optimizer themselves."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    grad_norms: list[float]
    model: nn.Module
    optimizer: torch.optim.Optimizer


def train_reference(model: nn.Module, optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
                    steps: int, step_loss: Callable[..., torch.Tensor], *, clip: float = 0.0, accumulation: int = 1,
                    before_step: Optional[Callable[[nn.Module, torch.optim.Optimizer, int], None]] = None,
                    after_backward: Optional[Callable[[nn.Module, int], None]] = None,
                    backward: Optional[Callable[[torch.Tensor, int], bool]] = None,
                    named_parameters_only: bool = False) -> Reference:
    """Plain PyTorch, one process, the global batch.

    `step_loss(model, step)` returns step `step`'s loss over the whole global batch (with `accumulation` > 1:
    `step_loss(model, step, micro)` returns micro-batch `micro`'s, and each is backpropagated divided by
    `accumulation`, as an accumulating loop does). `before_step(model, optimizer, step)` runs first in each step
    (e.g. a schedule setting the lr); `after_backward(model, step)` sees the gradients before clipping.
    Clipping (`clip` > 0) is over the parameters that have a gradient. The loss recorded is the step's mean.
    `backward(loss, step)`, if given, runs each backward instead of `loss.backward()` and returns whether it
    finished: False is a backward that raised midway and was caught, as a loop that skips a bad batch does: the
    rest of that step is abandoned (no clipping, no optimizer step, no zero_grad: its partial gradients stay in
    .grad for the next step) and no loss is recorded for it.
    `optimizer` may be a list (a model split over several optimizers): each steps, then each zeroes.
    `params` is the state dict (or, with `named_parameters_only`, the parameters alone) as fp32 clones."""
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    run_backward = backward or _plain_backward
    losses, norms = [], []
    for step in range(steps):
        if before_step is not None:
            before_step(model, optimizer, step)
        total, finished = 0.0, True
        for micro in range(accumulation):
            loss = step_loss(model, step) if accumulation == 1 else step_loss(model, step, micro)
            # divided by the micro-batches of a step, as an accumulating loop does (not at all without accumulation)
            finished = run_backward(loss if accumulation == 1 else loss / accumulation, step)
            if not finished:
                break
            total += float(loss.detach()) / accumulation
        if not finished:
            continue
        if after_backward is not None:
            after_backward(model, step)
        if clip:
            norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
            norms.append(float(norm))
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad()
        losses.append(total)
    items = model.named_parameters() if named_parameters_only else model.state_dict().items()
    return Reference(losses, {k: v.detach().float().clone() for k, v in items}, norms, model, optimizer)


def _plain_backward(loss: torch.Tensor, step: int) -> bool:
    loss.backward()
    return True


class RankBuffers:
    """Each data-parallel rank's own module buffers, for a reference of models whose buffers a rank updates from its
    own rows alone (BatchNorm's running statistics: data parallelism averages gradients, not buffers). Every
    forward of rank `rank`'s rows runs inside `of(model, rank)`, which loads that rank's buffers before and keeps
    them after; `per_rank[rank]` is what rank `rank` holds at the end. Such a reference runs one forward per rank
    and micro-batch (train_reference's `accumulation` = ranks x micro-steps), so that the batch statistics of each
    forward are one rank's, as under data parallelism."""

    def __init__(self, model: nn.Module, world: int) -> None:
        self.per_rank = [copy.deepcopy(dict(model.named_buffers())) for _ in range(world)]

    @contextlib.contextmanager
    def of(self, model: nn.Module, rank: int) -> Iterator[None]:
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(self.per_rank[rank][name])
        yield
        self.per_rank[rank] = copy.deepcopy(dict(model.named_buffers()))


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


def assert_matches_reference(rank: int, losses, params: dict, ref_losses, ref_params: dict, what: str = "") -> None:
    """One rank's losses and parameters equal the reference's within the FP32 tolerances (module docstring).
    `what` names the case."""
    where = f"rank {rank}{' ' + what if what else ''}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                               msg=lambda m: f"{where}: losses differ: {m}")
    assert_params_match_reference(rank, params, ref_params, what)


def assert_params_match_reference(rank: int, params: dict, ref_params: dict, what: str = "") -> None:
    """`assert_matches_reference` for a run that records no losses: the parameters alone, FP32 tolerances."""
    where = f"rank {rank}{' ' + what if what else ''}"
    for key, ref in ref_params.items():
        torch.testing.assert_close(params[key], ref, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{where}: {key} differs: {m}")


def assert_adam_params_close(params: dict, ref_params: dict, lr: float, steps: int, where: str = "") -> None:
    """Parameters trained by Adam(W) for `steps` steps at `lr` equal the reference's within the ADAM tolerance
    (module docstring): 4e-6 after 3 steps at lr 1e-2 was seen on a LoRA B column (1.3e-4 of lr * steps), which
    a pure relative tolerance on that element fails by luck of the draw; tests/dist/test_hf_stage3.py checks
    that an update wrong by 1e-4 in one element still fails."""
    atol = 1e-3 * lr * steps
    for key, ref in ref_params.items():
        torch.testing.assert_close(params[key], ref, rtol=1e-5, atol=atol,
                                   msg=lambda m: f"{where}: {key} differs beyond 1e-3 of lr * steps: {m}")


def assert_trained(ref_params: dict, init: dict, by: float = 1e-2) -> None:
    """The reference moved some parameter by more than `by`: the comparison is not between two
    untrained models."""
    assert max((ref_params[k] - init[k]).abs().max().item() for k in init) > by, "the reference did not train"
