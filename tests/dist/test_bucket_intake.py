"""Stages 0-1 take a bucket's gradients in with one hook, on its trigger parameter, once the first backward has
learned which parameter completes the bucket ([Note: arrivals read from version counters] in
grads/bucket_intake.py). Checked here: training equals single-process PyTorch on the models where gradient order
is unusual (a never-called layer, a frozen one, a module called twice, re-entrant checkpointing whose second
gradients come late, a tied weight, layers whose order flips every step), with several buckets per model so that
a trigger can fire while an earlier bucket still waits; a static graph settles on one hook per bucket and is
bitwise the hooks per parameter; a graph whose order changes goes back to hooks per parameter; a stray
loss.backward() that no hook saw is refused at the next engine.backward and never reaches a step (and a .grad set
by hand, which looks the same, with an error that says so); a backward that raised midway is taken in at the next
one, as the hooks per parameter take it in."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp
from zerodp.shard.grads import bucket_intake
from tests.dist import test_stage3_parity
from tests.dist.common import make_model, make_optimizer, micro_batch, reference_run
from tests.oracle import assert_params_match_reference, train_reference

BUCKET = 250  # elements: every case's model spans several buckets
# order_changes: its first bucket (first in reduction order) holds the head and both layers, whose order flips, so
# the trigger learned in one step fires early in the next, with the bucket's reduction launched at once
BUCKETS = {"order_changes": 490}


def hooks_on(model: torch.nn.Module) -> int:
    """Post-accumulate-grad hooks registered on the model's parameters."""
    return sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())


def intake_case(name: str, stage: int) -> tuple:
    """Case `name` of the stage-3 parity suite at `stage` with small buckets; also what the intakes did."""
    seen = {}
    initialize = zerodp.initialize

    def spy(model, *args, **kwargs):
        engine = initialize(model, *args, **kwargs)
        seen["engine"], seen["model"] = engine, model
        finish = engine.sharding.finish_micro_step

        def finish_and_count(boundary):
            received = finish(boundary)
            if boundary:  # the reduction rounds each bucket ran at this step's boundary
                seen["rounds"] = [b.grads.rounds_launched for b in engine.sharding.buckets]
            return received
        engine.sharding.finish_micro_step = finish_and_count
        return engine
    zerodp.initialize = spy
    try:
        result = test_stage3_parity.zerodp_case(name, stage=stage, zero={"reduce_bucket_size": BUCKETS.get(name, BUCKET)})
    finally:
        zerodp.initialize = initialize
    sharding = seen["engine"].sharding
    intakes = [i for i in sharding.intakes if i is not None]
    report = {"buckets": len(sharding.buckets), "hooks": hooks_on(seen["model"]), "intakes": len(intakes),
              "modes": [i.mode.name for i in intakes], "last_rounds": seen["rounds"]}
    seen["engine"].close()  # the spy's closure holds the engine: a cycle the pool's next test must not inherit
    return result, report


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("name", ["parity_net", "called_twice", "checkpoint_reentrant", "gpt_tied",
                                  "frozen_embedding", "order_changes"])
def test_bucket_triggers_train_like_pytorch(dist_run, name, stage):
    world = 2
    results = dist_run(world, intake_case, name, stage)
    ref_losses, ref_state, _ = test_stage3_parity.reference_case(name, world)
    test_stage3_parity.assert_matches([r for r, _ in results], ref_losses, ref_state)
    for _, report in results:
        assert report["buckets"] > (1 if name == "order_changes" else 2), report  # a trigger can fire while an earlier bucket waits
        assert report["intakes"] == report["buckets"], report
        if name == "order_changes":
            # the layers' order flips every step: a bucket whose trigger fired early goes back to a hook per parameter
            assert "PER_PARAMETER" in report["modes"], report
        else:
            # a static graph: learned in the first backward, one hook per bucket from then on; the last step
            # reduced each bucket once (checkpoint_reentrant: a weight's second gradient is late, as under hooks per
            # parameter, and needs a second round)
            assert report["modes"] == ["TRIGGER"] * report["buckets"], report
            assert report["hooks"] == report["buckets"], report
            if name != "checkpoint_reentrant":
                assert report["last_rounds"] == [1] * report["buckets"], report


def bitwise_both_ways(name: str, stage: int, zero: dict):
    """Case `name` with every bucket kept on hooks per parameter, then with triggers: both results."""
    saved = bucket_intake.BucketIntake.settle

    def never_leave_learning(self):
        return False
    bucket_intake.BucketIntake.settle = never_leave_learning
    try:
        hooked = test_stage3_parity.zerodp_case(name, stage=stage, zero=zero)
    finally:
        bucket_intake.BucketIntake.settle = saved
    return hooked, test_stage3_parity.zerodp_case(name, stage=stage, zero=zero)


@pytest.mark.parametrize("name", ["parity_net", "checkpoint_reentrant", "gpt_tied"])
def test_triggers_are_bitwise_the_hooks_per_parameter(dist_run, name):
    """A static graph: the same reductions at the same points, so the same bits (losses and every tensor)."""
    for hooked, triggered in dist_run(2, bitwise_both_ways, name, 1, {"reduce_bucket_size": BUCKET}):
        assert hooked[0] == triggered[0]
        for key, value in hooked[1].items():
            assert torch.equal(triggered[1][key], value), key


def stray_run(stray: bool) -> dict:
    """A stray loss.backward() that reaches no trigger (only the last layer's gradients, and no trigger is
    among them): refused at the next engine.backward, then training goes on as if it never happened."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer("sgd", model),
                               {"zero_optimization": {"stage": 1, "reduce_bucket_size": BUCKET}})
    triggers = {id(b.params[i.trigger]) for b, i in zip(engine.sharding.buckets, engine.sharding.intakes)}
    out = {"error": None}
    for step in range(3):
        x, y = micro_batch(step, 0, rank, world, 2, 1)
        if stray and step == 1:
            last = [p for p in model.parameters() if p.requires_grad][-1]
            assert id(last) not in triggers, "the case needs a stray gradient that reaches no trigger"
            last.sum().backward()  # the mistake, on a parameter without a hook
            try:
                engine.backward(F.mse_loss(engine(x), y))
            except RuntimeError as err:
                out["error"] = str(err)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    out["params"] = {k: p.detach().clone() for k, p in model.named_parameters()}
    engine.close()
    return out


def test_a_stray_gradient_no_hook_saw_is_refused_at_the_next_backward(dist_run):
    clean = dist_run(2, stray_run, False)
    stray = dist_run(2, stray_run, True)
    _, ref_params = reference_run("sgd", 3, 4, 0.0)  # 3 steps of the global batch (2 ranks x 2 rows)
    for rank, (c, s) in enumerate(zip(clean, stray)):
        assert s["error"] is not None and "call engine.backward(loss) instead of loss.backward()" in s["error"]
        assert "found at the next engine.backward" in s["error"]
        for key, value in c["params"].items():
            assert torch.equal(value, s["params"][key]), "the stray gradient must not reach the step"
        assert_params_match_reference(rank, c["params"], ref_params)


class _Raised(Exception):
    """Raised by a tensor hook in the middle of a backward (as a user's hook, or an out-of-memory error, can)."""


def _raise(grad):
    raise _Raised()


# the layers each step runs: step 2's backward raises after `c`'s and the head's gradients arrived (before `b`'s);
# `c` is unused in the two steps after it, so only the failed backward's gradient says whether it is stepped
PATHS = ["abc", "abc", "abc", "ab", "ab", "abc"]


class _Layers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(6, 6) for _ in range(3))
        self.out = torch.nn.Linear(6, 3)

    def forward(self, x, path: str):
        for name in path:
            x = torch.tanh(getattr(self, name)(x))
        return self.out(x)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)


def _batch(step: int, rows: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


def _path_loss(model, step: int, rows: int, lo: int) -> torch.Tensor:
    """Step `step`'s loss along PATHS[step]: the global batch (`lo` < 0) or half of it from row `lo`."""
    x, y = _batch(step, rows)
    if lo >= 0:
        x, y = x[lo:lo + rows // 2], y[lo:lo + rows // 2]
    return F.mse_loss(model(x, PATHS[step]), y)


def _backward_through_the_raise(model, backward, loss: torch.Tensor, step: int, before_raise=lambda: None) -> bool:
    """`backward(loss)`, except that step 2's raises midway; returns whether it finished. The caller then skips the
    batch and trains on: its partial gradients stay, as plain PyTorch keeps them in .grad without a zero_grad."""
    if step != 2:
        backward(loss)
        return True
    before_raise()
    handle = model.b.weight.register_hook(_raise)
    with pytest.raises(_Raised):
        backward(loss)
    handle.remove()
    return False


def raised_backward_run(stage: int, per_parameter: bool, zero: dict | None = None) -> tuple:
    rank = dist.get_rank()
    model = _Layers()
    engine = zerodp.initialize(model, _sgd(model), {"zero_optimization": {"stage": stage, **(zero or {})}})
    saved = bucket_intake.BucketIntake.settle
    if per_parameter:
        bucket_intake.BucketIntake.settle = lambda self: False  # every bucket keeps its hooks per parameter
    modes = []
    try:
        def before_raise():
            modes.extend(i.mode.name for i in getattr(engine.sharding, "intakes", []) if i is not None)
        for step in range(len(PATHS)):
            loss = _path_loss(engine.module, step, 4, 2 * rank)
            if _backward_through_the_raise(engine.module, engine.backward, loss, step, before_raise):
                engine.step()
    finally:
        bucket_intake.BucketIntake.settle = saved
        engine.close()  # also when it raised: the pool's next test must not inherit its threads
    return modes, [p.detach().clone() for p in model.parameters()]


def plain_run_through_a_raise() -> torch.nn.Module:
    """The reference: the oracle on the global batch through the same raise (its partial .grads kept)."""
    model = _Layers()

    def backward(loss: torch.Tensor, step: int) -> bool:
        return _backward_through_the_raise(model, torch.Tensor.backward, loss, step)
    return train_reference(model, _sgd(model), len(PATHS), lambda m, step: _path_loss(m, step, 4, -1),
                           backward=backward).model


@pytest.mark.parametrize("stage", [0, 1])
def test_a_backward_that_raised_is_taken_in_like_the_hooks_per_parameter(dist_run, stage):
    """A backward that raises midway (a user's hook) leaves gradients in the buffer that no trigger saw (the bucket's
    trigger, learned in step 0, never fires in it): the next engine.backward takes them in (each such parameter is
    stepped), as the hooks per parameter and plain PyTorch do."""
    model = plain_run_through_a_raise()
    for (modes, triggered), (_, hooked) in zip(dist_run(2, raised_backward_run, stage, False),
                                               dist_run(2, raised_backward_run, stage, True)):
        assert modes == ["TRIGGER"], modes  # the failing backward runs on the trigger's hook alone
        for t, h, ref in zip(triggered, hooked, model.parameters()):
            assert torch.equal(t, h)
            # two ranks' means averaged where the reference takes the global batch's mean: fp32 summation order
            torch.testing.assert_close(t, ref.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_grad_set_by_hand_is_refused_naming_both_causes(stage):
    """One rank, in this process: pre-allocated .grads look like a stray backward's; the error says so."""
    model = _Layers()
    engine = zerodp.initialize(model, _sgd(model), {"zero_optimization": {"stage": stage}})
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    x, y = _batch(0, 2)
    with pytest.raises(RuntimeError, match=r"on 8 parameter\(s\); nothing of it was added\)\. A \.grad set by hand"):
        engine.backward(F.mse_loss(engine(x, "abc"), y))
    assert all(p.grad is None for p in model.parameters())
    engine.backward(F.mse_loss(engine(x, "abc"), y))  # and training goes on
    engine.step()
    engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_backward_that_raised_after_a_reduction_launched_trains_on(dist_run, stage):
    """Small buckets, overlapped reductions: the failing backward has launched the head's and `c`'s buckets before it
    raises. The next engine.backward finishes those reductions and keeps their sums aside (as a late gradient's
    round does), so the gradients of the failed backward count once, as plain PyTorch's partial .grads do; before,
    every later backward was refused ("still reducing")."""
    model = plain_run_through_a_raise()
    zero = {"reduce_bucket_size": 30, "overlap_comm": True}
    for _, params in dist_run(2, raised_backward_run, stage, False, zero):
        for t, ref in zip(params, model.parameters()):
            torch.testing.assert_close(t, ref.detach(), rtol=1e-5, atol=1e-6)  # as above: fp32 summation order


def test_stage3_after_a_raised_backward_says_what_to_do(dist_run):
    """Stage 3's units stay mid-backward after a raise: the next engine.backward is refused, naming the way out."""
    from tests.dist.harness import WorkerError

    with pytest.raises(WorkerError, match="stage 3 cannot: load the last checkpoint"):
        dist_run(2, raised_backward_run, 3, False, {"stage3_unit_min_params": 10})
