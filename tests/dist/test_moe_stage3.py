"""Mixture-of-Experts at stage 3 with no per-model code (issue 42, parts 1 and 2).

- The classic MoE (tests/dist/moe_common.py) at the DEFAULT stage-3 config, with tokens routed differently
  on each rank and experts unused on some steps, equals plain PyTorch on the global batch: the default unit
  policy keeps the repeated blocks whole (stage3/blocks.py), so ranks gather the same units.
- Where units are chosen so that ranks gather different units of equal size (forced here: each rank calls
  its own expert), the gather check (stage3/gather_ledger.py) stops every rank within the step, naming the
  module each rank gathered; without the check the same run goes through with silently mixed weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import zerodp
from tests.dist import harness
from tests.dist.common import assert_adam_params_close, assert_matches_reference
from tests.dist.moe_common import IN, OUT, WIDTH, Expert, make_moe, moe_batch
from tests.oracle import train_reference

STEPS, ROWS_PER_RANK, LR = 5, 2, 1e-3


def _optimizer(name: str, model: nn.Module):
    # SGD with momentum and weight decay: a parameter that got no gradient on any rank must be skipped as torch
    # skips it (stepping it with a zero gradient would still move it by the momentum and the decay)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=LR * 10, momentum=0.9, weight_decay=1e-2)
    # eps 1e-6 (torch's default 1e-8): with one or two tokens per expert, a whole row of an expert's weight gets
    # a gradient that is float noise (~1e-10: a hidden unit whose gelu slope is ~0 for that token); eps 1e-8
    # turns that noise into lr-sized updates whose sign depends on summation order (measured: a row off by 3%
    # of lr * steps after 5 steps); at 1e-6 noise moves it by 1e-4 of lr, while real gradients (>= 1e-4 here)
    # are still normalized as Adam does
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6)


def _reference(world: int, opt_name: str):
    used = []

    def step_loss(model, step: int) -> torch.Tensor:
        x, y = moe_batch(step, ROWS_PER_RANK * world)
        return F.mse_loss(model(x), y)

    def note_used(model, step: int) -> None:
        used.append(model.used_experts())  # read after the step in the loop this replaces: the forward set it

    model = make_moe()
    ref = train_reference(model, _optimizer(opt_name, model), STEPS, step_loss, after_backward=note_used)
    return ref.losses, ref.params, used


def _zerodp_default_stage3(opt_name: str):
    world = dist.get_world_size()
    model = make_moe()
    engine = zerodp.initialize(model, _optimizer(opt_name, model),
                               {"zero_optimization": {"stage": 3}})  # the default unit policy: nothing else set
    units = [mu.name for mu in engine.sharding.module_units]
    losses, params, used = _train_rank_rows(engine, model, STEPS, lambda step: moe_batch(step, ROWS_PER_RANK * world),
                                            ROWS_PER_RANK)
    return losses, params, used, units


def _train_rank_rows(engine, model, steps: int, batch, rows_per_rank: int):
    """Train on this rank's rows of each global `batch(step)`; returns the global mean losses, the full parameters
    and the experts each step used on this rank (the engine is closed)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, used = [], []
    for step in range(steps):
        x, y = batch(step)
        rows = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
        loss = F.mse_loss(engine(x[rows]), y[rows])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        used.append(model.used_experts())
    with zerodp.gathered_parameters(model.parameters()):
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.close()
    return losses, params, used


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_classic_moe_default_config_is_exact_at_stage3(opt_name):
    ref_losses, ref_params, ref_used = _reference(2, opt_name)
    results = harness.run(2, _zerodp_default_stage3, opt_name)
    (_, _, used0, units), (_, _, used1, _) = results
    # the case is the hard one: ranks route differently, and an expert is unused on some steps and used on others
    assert any(a != b for a, b in zip(used0, used1)), "every rank routed to the same experts: not the case"
    # an expert used by some rank on one step and by no rank on a later one: its skip must be torch's (with
    # momentum and weight decay, a zero-gradient step would still move it)
    layers = len(ref_used[0])
    assert any(e in ref_used[i][layer] and e not in ref_used[j][layer]
               for layer in range(layers) for i in range(STEPS) for j in range(i + 1, STEPS) for e in range(8)), \
        "no expert was used and later unused on every rank: not the case"
    # units at the repeated blocks' granularity: nothing inside a block is gathered on its own
    assert units == ["<root>", "blocks.0", "blocks.1"], units
    for rank, (losses, params, _, _) in enumerate(results):
        if opt_name == "sgd":  # the same sums in another order: fp32 rounding only
            assert_matches_reference(rank, losses, params, ref_losses, ref_params, "classic MoE, SGD")
        else:
            # Adam's first steps move every element by ~lr whatever its gradient's size, so the summation-order
            # noise of near-zero gradients (2M parameters, 1-2 tokens per expert) becomes a visible fraction
            # of lr in a few elements (see assert_adam_params_close); the loss follows at ~1e-5 relative
            # (measured 1.1e-5 at step 1), so losses get rtol 1e-4: a wrong expert or a missed skip moves
            # them by 1e-3 or more (see the SGD case for the tight check).
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
            assert_adam_params_close(params, ref_params, LR, STEPS, where=f"rank {rank}")


# -- the gather check: units that differ per rank -------------------------------------------------


class RankExperts(nn.Module):
    """Each rank calls its own expert: rank r gathers experts.r, of the same size on every rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.embed = nn.Linear(IN, WIDTH)
        self.experts = nn.ModuleList(Expert(WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.experts[dist.get_rank()](self.embed(x)))


# set explicitly, the threshold alone decides: each expert Linear (131,072 elements) is a unit of its own
_PER_EXPERT_UNITS = {"zero_optimization": {"stage": 3, "stage3_unit_min_params": 100_000}}


def _rank_experts_engine(check: bool):
    model = RankExperts()
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), _PER_EXPERT_UNITS)
    if not check:
        ledger = engine.sharding.shards.ledger
        ledger.record = lambda index: None  # every rank's gather sequence looks alike: the check sees nothing
    return engine


def _forced_mismatch(check: bool):
    x, y = moe_batch(0, 2)
    expected = RankExperts()(x).detach()  # this rank's own expert, unsharded: what a correct forward returns
    errors, outputs = [], []
    engine = _rank_experts_engine(check)
    out = engine(x)
    outputs.append(out.detach())
    try:
        engine.backward(F.mse_loss(out, y))
        engine.step()
    except zerodp.UnitMismatchError as e:
        errors.append(str(e))
    engine = _rank_experts_engine(check)  # the first one stopped mid-step
    try:
        with torch.no_grad():  # a forward no backward follows: checked when the root's forward ends
            outputs.append(engine(x))
    except zerodp.UnitMismatchError as e:
        errors.append(str(e))
    mixed = [not torch.allclose(o, expected, atol=1e-5) for o in outputs]
    return errors, mixed


def test_gather_mismatch_of_equal_sizes_stops_every_rank_naming_both_modules():
    for rank, (errors, _) in enumerate(harness.run(2, _forced_mismatch, True)):
        assert len(errors) == 2, f"rank {rank}: the training step and the no_grad forward must both stop: {errors}"
        for message in errors:
            assert "gather #1" in message, message
            assert f"rank {rank} (this rank) gathered 'experts.{rank}.w1'" in message, message
            other = 1 - rank
            assert f"rank {other} gathered 'experts.{other}.w1'" in message, message
            assert "stage3_unit_modules" in message and "set_z3_leaf_modules" in message, message


def test_without_the_check_the_same_gathers_mix_weights_silently():
    """What the check prevents (and why the test above fails without it): no error, a wrong forward."""
    for rank, (errors, mixed) in enumerate(harness.run(2, _forced_mismatch, False)):
        assert errors == [], f"rank {rank}: {errors}"
        assert mixed == [True, True], f"rank {rank}: a forward used its own expert's weights: nothing was mixed"


# -- a unit complete in backward on one rank and not on another (issue 42's stage-3 hang) --------------------

UNEVEN_STEPS, UNEVEN_ROWS = 3, 16


def _uneven_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's rows are diverse (every expert gets a token), rank 1's are one row repeated (two experts do):
    each block's unit is complete on rank 0 as its backward runs and incomplete on rank 1 until backward ends."""
    x, y = moe_batch(step, 2 * UNEVEN_ROWS)
    x[UNEVEN_ROWS:] = x[UNEVEN_ROWS]
    return x, y


def _uneven_reference():
    model = make_moe()
    ref = train_reference(model, torch.optim.SGD(model.parameters(), lr=LR * 10, momentum=0.9), UNEVEN_STEPS,
                          lambda m, step: F.mse_loss(m(_uneven_batch(step)[0]), _uneven_batch(step)[1]))
    return ref.losses, ref.params


def _checkpointed(model: nn.Module, use_reentrant: bool) -> nn.Module:
    """Each block called under torch's activation checkpointing (its module hooks inside the checkpointed region):
    re-entrant, the first forward runs without autograd and the block's backward is its recomputation's, whose end
    the module unit sees on the recomputed inputs (module_unit.py)."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        h = model.embed(x)
        for block in model.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=use_reentrant)
        return model.head(h)

    model.forward = forward
    return model


def _zerodp_uneven(overlap_comm: bool, checkpointing: str):
    model = make_moe()
    if checkpointing != "none":
        model = _checkpointed(model, use_reentrant=checkpointing == "reentrant")
    # a short collective timeout: the hang this guards against is then a watchdog error naming the collectives,
    # seconds in, rather than a test that never ends
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR * 10, momentum=0.9),
                               {"zero_optimization": {"stage": 3, "overlap_comm": overlap_comm},
                                "comm_timeout_s": 30})
    queue, finish = engine.sharding.queue, engine.sharding.queue.finish
    in_backward = []  # per step: each block unit's reductions launched before the end of backward

    def recording_finish(*args, **kwargs):
        in_backward.append({g.name: g.rounds_launched for g in queue.order if g.name.startswith("blocks.")})
        return finish(*args, **kwargs)

    queue.finish = recording_finish
    return (*_train_rank_rows(engine, model, UNEVEN_STEPS, _uneven_batch, UNEVEN_ROWS), in_backward)


@pytest.mark.parametrize("overlap_comm,checkpointing", [(False, "none"), (True, "none"), (False, "reentrant"),
                                                         (True, "non-reentrant")])
def test_a_unit_complete_on_one_rank_only_reduces_without_waiting_on_the_other(overlap_comm, checkpointing):
    """Rank 0 completes each block's unit during backward and used to wait on its reduction there (at once with
    overlap_comm false, after two with true), while rank 1, where an expert got no token, launched it only after
    the end-of-backward control collective: a hang (reduce_queue.py, [Note: waiting before the control
    collective]). Now rank 1 launches it when the block's backward ends, and the result is the reference's, also
    with the blocks under activation checkpointing (re-entrant: the backward's end is a recomputation's)."""
    ref_losses, ref_params = _uneven_reference()
    results = harness.run(2, _zerodp_uneven, overlap_comm, checkpointing)
    (_, _, used0, _), (_, _, used1, _) = results
    assert all(len(layer) == 8 for step in used0 for layer in step), f"rank 0 left an expert unused: {used0}"
    assert all(len(layer) < 8 for step in used1 for layer in step), f"rank 1 used every expert: {used1}"
    for rank, (_, _, _, in_backward) in enumerate(results):
        # every block's reduction starts in backward on both ranks, rank 1's too (where the unit is never complete):
        # memory stays bounded by the units in flight, not the whole model's gradients held to the end
        assert all(step and all(n == 1 for n in step.values()) for step in in_backward), f"rank {rank}: {in_backward}"
    for rank, (losses, params, _, _) in enumerate(results):
        assert_matches_reference(rank, losses, params, ref_losses, ref_params, "experts unused on rank 1 only")
