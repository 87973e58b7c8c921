"""Bad inputs to zerodp.initialize / the engine get errors that name the problem and the fix.
World size 1 with no process group: these run in the pytest process."""

import pytest
import torch
import torch.nn.functional as F

import zerodp
from zerodp.optim.inner import OptimizerError
from tests.dist.common import make_model, make_optimizer


def test_non_elementwise_optimizer_is_refused():
    # (Adafactor, once the example here, is exact now: its groups get whole tensors per rank)
    model = make_model()
    with pytest.raises(OptimizerError, match=r"register_whole_tensor\(LBFGS\)") as err:
        zerodp.initialize(model, torch.optim.LBFGS(model.parameters()), {})
    assert "zero_allow_untested_optimizer" in str(err.value)


def test_untested_optimizer_allowed_when_asserted():
    class MySGD(torch.optim.SGD):
        pass

    model = make_model()
    engine = zerodp.initialize(model, MySGD(model.parameters(), lr=0.1), {"zero_allow_untested_optimizer": True})
    assert isinstance(engine.optimizer.optimizer, MySGD)


def test_optimizer_over_foreign_tensor():
    model = make_model()
    with pytest.raises(zerodp.ConfigError, match="not a parameter of the model"):
        zerodp.initialize(model, torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1), {})


def test_trainable_parameter_missing_from_optimizer():
    model = make_model()
    with pytest.raises(zerodp.ConfigError, match="not in the optimizer: gain, embed.bias, hidden.weight.*add them or set requires_grad=False"):
        zerodp.initialize(model, torch.optim.SGD([model.embed.weight], lr=0.1), {})


def test_optimizer_given_twice_and_none():
    model = make_model()
    cfg = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(OptimizerError, match="keep one"):
        zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    with pytest.raises(OptimizerError, match="no optimizer"):
        zerodp.initialize(model, None, {})
    with pytest.raises(OptimizerError, match="unknown"):
        zerodp.initialize(model, None, {"optimizer": {"type": "Sophia", "params": {}}})


def test_optimizer_that_already_stepped():
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    F.mse_loss(model(torch.randn(2, 12)), torch.randn(2, 5)).backward()
    opt.step()
    with pytest.raises(OptimizerError, match="already has state"):
        zerodp.initialize(model, opt, {})


def test_step_without_backward_and_non_scalar_loss():
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer("sgd", model), {})
    with pytest.raises(RuntimeError, match="without engine.backward"):
        engine.step()
    with pytest.raises(ValueError, match="scalar loss"):
        engine.backward(engine(torch.randn(2, 12)).sum(dim=1))


def test_callable_optimizer_and_read_only_figures():
    model = make_model()
    engine = zerodp.initialize(model, lambda params: torch.optim.SGD(params, lr=0.1), {"gradient_clipping": 1.0})
    engine.backward(F.mse_loss(engine(torch.randn(2, 12)), torch.randn(2, 5)))
    engine.step()
    assert engine.global_step == 1 and engine.micro_step == 1 and engine.loss_scale == 1.0
    assert engine.grad_norm is not None and engine.grad_norm > 0
    with pytest.raises(AttributeError):
        engine.grad_norm = 1.0


def test_wall_clock_breakdown_times_each_phase(caplog):
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer("sgd", model),
                               {"wall_clock_breakdown": True, "steps_per_print": 2})
    with caplog.at_level("INFO", logger="zerodp"):
        for _ in range(2):
            engine.backward(F.mse_loss(engine(torch.randn(2, 12)), torch.randn(2, 5)))
            if engine.global_step == 0 and engine.micro_step == 0:
                assert engine.timings["forward"] > 0 and engine.timings["backward"] > 0
            engine.step()
    assert "forward=" in caplog.text and "backward=" in caplog.text and "step=" in caplog.text
    assert engine.timings == {"forward": 0.0, "backward": 0.0, "step": 0.0}  # reset after each log


def test_stage3_honours_overlap_comm_and_reduce_scatter():
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer("sgd", model),
                               {"zero_optimization": {"stage": 3, "overlap_comm": False, "reduce_scatter": False}})
    assert engine.sharding.max_inflight == 0  # each reduction is waited on as soon as it is launched
    assert all(u.shards.use_all_reduce for u in engine.units)
    other = make_model()
    default = zerodp.initialize(other, make_optimizer("sgd", other), {"zero_optimization": {"stage": 3}})
    assert default.sharding.max_inflight > 0 and not default.units[0].shards.use_all_reduce
