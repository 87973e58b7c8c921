"""A NaN/Inf in one rank's loss or one gradient never reaches the parameters (bf16/fp32).

`nonfinite: stop` (the default) raises on every rank at the same step, naming the step, the rank
whose loss was not finite and the first parameter whose gradient was not finite, with nothing written;
`nonfinite: skip` skips that step on every rank and training goes on.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp
from tests.dist.common import make_model, make_optimizer, micro_batch

BAD_STEP = 1


def nan_run(stage: int, policy: str, where: str, precision: str, nvme: str = "") -> dict:
    """Three steps; at BAD_STEP rank 1 gets a NaN loss (where='loss') or a NaN out.bias gradient.
    `nvme`: offload_param to this folder (in fp32 the gradient shards live there too)."""
    rank = dist.get_rank()
    model = make_model()
    cfg = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                 "stage3_unit_min_params": 1},
           "gradient_clipping": 1.0, "nonfinite": policy}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if nvme:
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 10}
    engine = zerodp.initialize(model, make_optimizer("adamw", model), cfg)
    out = {"changed": [], "error": None}
    for step in range(3):
        x, y = micro_batch(step, 0, rank, dist.get_world_size(), 2, 1)
        hook = None
        if step == BAD_STEP and rank == 1 and where == "grad":
            hook = model.out.bias.register_hook(lambda g: torch.full_like(g, math.nan))
        with zerodp.gathered_parameters(list(model.parameters())):
            before = [p.detach().float().clone() for p in model.parameters()]
        loss = F.mse_loss(engine(x).float(), y)
        if step == BAD_STEP and rank == 1 and where == "loss":
            loss = loss * math.nan
        engine.backward(loss)
        if hook is not None:
            hook.remove()
        try:
            engine.step()
        except zerodp.NonFiniteError as err:
            out["error"] = str(err)
            out["error_step"] = step
        with zerodp.gathered_parameters(list(model.parameters())):
            after = [p.detach().float().clone() for p in model.parameters()]
        out["changed"].append(any(not torch.equal(a, b) for a, b in zip(before, after)))
        out["finite"] = all(bool(torch.isfinite(p).all()) for p in after)
        if out["error"]:
            break
    out["grads_offloaded"] = any(u.grad_offloaded for u in engine.units)
    out["nonfinite_steps"] = engine.nonfinite_steps
    out["skipped"] = engine.skipped_steps
    with zerodp.gathered_parameters(list(model.parameters())):
        out["params"] = [p.detach().float().clone() for p in model.parameters()]
    return out


@pytest.mark.parametrize("where", ["loss", "grad"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stop_names_step_rank_and_parameter(dist_run, stage, precision, where):
    results = dist_run(2, nan_run, stage, "stop", where, precision)
    for r in results:
        assert r["error"] is not None, "every rank must stop at the bad step"
        assert r["error_step"] == BAD_STEP
        assert r["changed"] == [True, False], "the bad step must write nothing"
        assert r["finite"]
        assert f"optimizer step {BAD_STEP + 1}" in r["error"]
        if where == "loss":
            assert "the loss was not finite on rank 1" in r["error"]
        else:
            assert "'out.bias'" in r["error"] and "loss was not finite" not in r["error"]
    assert results[0]["error"] == results[1]["error"], "every rank prints the same diagnosis"


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_offloaded_gradient_shards_are_checked_too(dist_run, tmp_path, policy):
    """fp32 offload_param nvme: the gradient shards live in files; the norm kept from their delivery
    catches the NaN, the diagnosis reads them back one at a time, and skipping writes nothing."""
    results = dist_run(2, nan_run, 3, policy, "grad", "fp32", str(tmp_path))
    for r in results:
        assert r["grads_offloaded"]
        assert r["finite"]
        if policy == "stop":
            assert r["error_step"] == BAD_STEP and r["changed"] == [True, False]
            assert "'out.bias'" in r["error"]
        else:
            assert r["error"] is None and r["changed"] == [True, False, True] and r["nonfinite_steps"] == 1
    assert results[0]["params"] and all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_skip_skips_the_step_on_every_rank(dist_run, stage, precision):
    results = dist_run(2, nan_run, stage, "skip", "loss", precision)
    for r in results:
        assert r["error"] is None
        assert r["changed"] == [True, False, True], "only the bad step is skipped"
        assert r["finite"] and r["nonfinite_steps"] == 1 and r["skipped"] == 1
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b), "ranks hold identical parameters after a skipped step"


@pytest.mark.parametrize("lr", [math.inf, math.nan])
def test_nonfinite_learning_rate_is_refused_up_front(lr):
    model = make_model()
    with pytest.raises(zerodp.ConfigError, match="lr=.*finite"):
        zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=lr), {})  # torch.optim.SGD accepts both


def test_nonfinite_learning_rate_from_a_schedule_is_refused_before_the_step():
    model = make_model()
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    x, y = micro_batch(0, 0, 0, 1, 2, 1)
    engine.backward(F.mse_loss(engine(x), y))
    engine.optimizer.param_groups[0]["lr"] = math.inf
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(zerodp.ConfigError, match="lr=inf"):
        engine.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("cfg", [{"gradient_clipping": math.inf}, {"gradient_clipping": math.nan},
                                 {"fp16": {"enabled": True, "loss_scale": math.inf}}])
def test_nonfinite_config_value_is_refused(cfg):
    with pytest.raises(zerodp.ConfigError, match="finite"):
        zerodp.load_config(cfg)
