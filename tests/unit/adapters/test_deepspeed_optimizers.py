"""DeepSpeed's optimizer types mean what they mean in DeepSpeed, checked against the update formulas."""

from __future__ import annotations

import math

import pytest
import torch

from zerodp.config import ConfigError, load_config
from zerodp.config.auto import hidden_size, resolve_auto
from zerodp.optim.inner import OptimizerError, build_from_section


def _run(section_type, params, steps=3, seed=0):
    """Step the built optimizer on a fixed weight and gradient sequence; returns (optimizer, weights)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(6, generator=g))
    opt = build_from_section(section_type, params, [p])
    grads = [torch.randn(6, generator=g) for _ in range(steps)]
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
    return opt, p.detach(), grads


def _adam_reference(w, grads, lr, b1, b2, eps, wd, decoupled, bias_correction=True):
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    w = w.clone()
    for t, g in enumerate(grads, 1):
        if not decoupled:
            g = g + wd * w
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        bc1, bc2 = (1 - b1 ** t, 1 - b2 ** t) if bias_correction else (1, 1)
        u = (m / bc1) / ((v / bc2).sqrt() + eps)
        if decoupled:
            u = u + wd * w
        w = w - lr * u
    return w


def _start(seed=0):
    return torch.randn(6, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("type_, params, decoupled", [
    ("Adam", {}, True),                                   # DeepSpeed: Adam is AdamW-style unless told otherwise
    ("Adam", {"adam_w_mode": True}, True),
    ("Adam", {"adam_w_mode": False}, False),              # L2 decay added to the gradient
    ("Adam", {"adam_w_mode": False, "torch_adam": True}, False),
    ("AdamW", {"adam_w_mode": False}, True),              # type AdamW is always decoupled
    ("AdamW", {"torch_adam": True}, True),
    ("adam", {"bias_correction": False}, True),
    ("Adam", {"bias_correction": False, "adam_w_mode": False}, False),
])
def test_adam_types_follow_deepspeed(type_, params, decoupled):
    hyper = {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}
    _, got, grads = _run(type_, {**hyper, **params})
    want = _adam_reference(_start(), grads, 0.01, 0.8, 0.99, 1e-6, 0.1, decoupled,
                           bias_correction=params.get("bias_correction", True))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_adamw_weight_decay_default_is_fusedadams_zero():
    opt, _, _ = _run("AdamW", {"lr": 0.01})
    assert opt.param_groups[0]["weight_decay"] == 0.0
    opt, _, _ = _run("AdamW", {"lr": 0.01, "torch_adam": True})
    assert opt.param_groups[0]["weight_decay"] == 0.01  # torch's AdamW, as DeepSpeed builds it with torch_adam


def _lamb_reference(w, grads, lr, b1, b2, eps, wd, max_coeff, min_coeff, bias_correction):
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    w = w.clone()
    for t, g in enumerate(grads, 1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = m / (v.sqrt() + eps) + wd * w
        coeff = min(max(float(w.norm() / u.norm()), min_coeff), max_coeff)
        step_size = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) if bias_correction else lr
        w = w - step_size * coeff * u
    return w


@pytest.mark.parametrize("params", [
    {"lr": 0.011, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3, "min_coeff": 0.01},  # BingBert
    {"lr": 0.02, "weight_decay": 0.0},                                                                  # defaults
    {"lr": 0.02, "max_coeff": 10.0, "min_coeff": 5.0},                                                  # clamped up
])
def test_lamb_is_deepspeeds_fused_lamb(params):
    _, got, grads = _run("Lamb", params, steps=4)
    want = _lamb_reference(_start(), grads, params["lr"], 0.9, 0.999, 1e-8, params.get("weight_decay", 0.0),
                           params.get("max_coeff", 10.0), params.get("min_coeff", 0.01),
                           params.get("bias_correction", True))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("type_, params, fragment", [
    ("Adam", {"lr": "auto"}, "params lr are 'auto'.*write values"),
    ("Adam", {"amsgrad": True}, "amsgrad needs 'torch_adam': true"),
    ("OneBitAdam", {}, "does not run with ZeRO"),
    ("MuAdam", {}, "MuAdam is not implemented"),  # (Lion is implemented: test_deepspeed_cpu_optimizers.py)
    ("Lamb", {"amsgrad": True}, "amsgrad is not supported"),
    ("Lamb", {"max_coef": 1.0}, "bad params"),
])
def test_bad_optimizer_sections_name_the_problem(type_, params, fragment):
    with pytest.raises(OptimizerError, match=fragment):
        build_from_section(type_, params, [torch.nn.Parameter(torch.zeros(2))])


def test_optimizer_max_grad_norm_equal_to_gradient_clipping_is_one_clipping():
    cfg = load_config({"gradient_clipping": 1.0, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}})
    assert "max_grad_norm" not in cfg.optimizer.params and any("max_grad_norm" in n for n in cfg._notes)
    with pytest.raises(ConfigError, match="clip with the top-level 'gradient_clipping'"):
        load_config({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 2.0}}})


class _HFLike(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"hidden_size": 32})()
        self.proj = torch.nn.Linear(32, 32)


def test_auto_bucket_sizes_follow_the_hidden_size_as_hf():
    cfg = load_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                             "stage3_prefetch_bucket_size": "auto",
                                             "stage3_param_persistence_threshold": "auto"},
                       "train_micro_batch_size_per_gpu": 2, "train_batch_size": "auto"})
    out = resolve_auto(cfg, _HFLike()).zero_optimization
    assert (out.reduce_bucket_size, out.stage3_prefetch_bucket_size, out.stage3_param_persistence_threshold) == \
        (32 * 32, int(0.9 * 32 * 32), 320)
    assert hidden_size(torch.nn.Sequential(torch.nn.Embedding(10, 24), torch.nn.Linear(24, 5))) == 24


def test_auto_batch_sizes_and_precision():
    cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                       "gradient_accumulation_steps": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}})
    assert not cfg.fp16.enabled and not cfg.bf16.enabled
    assert resolve_auto(cfg, _HFLike()).resolve_batch(world_size=3) == (12, 4, 1)
    cfg = load_config({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"})
    assert resolve_auto(cfg, _HFLike()).resolve_batch(world_size=3) == (24, 4, 2)


@pytest.mark.parametrize("config, fragment", [
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}, "write train_micro_batch_size_per_gpu"),
    ({"gradient_clipping": "auto"}, "1.0 is the HF Trainer's default"),
])
def test_unresolvable_auto_names_the_value_to_write(config, fragment):
    with pytest.raises(ConfigError, match=fragment):
        resolve_auto(load_config(config), _HFLike())


def test_auto_values_can_be_supplied_by_an_integration():
    cfg = load_config({"gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
                      auto_values={"gradient_clipping": 0.5, "optimizer.params.lr": 3e-4})
    assert cfg.gradient_clipping == 0.5 and cfg.optimizer.params["lr"] == 3e-4


@pytest.mark.parametrize("config, fragment", [
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 0}}, "only meaningful at stage 3"),
    ({"zero_optimization": {"allgather_partitions": False}}, "allgather_partitions=false"),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "same setting"),
    ({"comet": {"enabled": True}}, "Comet monitor is not implemented"),
    ({"zero_optimization": {"zeropp_loco_param": {"err_beta": 0.8}}}, "LoCo is not implemented"),
    ({"steps_per_print": "auto"}, "'steps_per_print' is 'auto'"),
    ({"zero_optimization": {"sub_grup_size": 1}}, "did you mean 'sub_group_size'"),
])
def test_compat_refusals_name_the_feature(config, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(config)


def test_aliases_and_no_effect_keys():
    cfg = load_config({"bfloat16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": 0, "stage3_gather_fp16_weights_on_model_save": True,
        "max_live_parameters": 123, "sub_group_size": 1e9, "allgather_partitions": True,
        "offload_optimizer": {"device": "none"}}, "prescale_gradients": False, "tensorboard": {"enabled": False}})
    assert cfg.bf16.enabled and cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save
    assert cfg.zero_optimization.stage3_max_live_parameters == 123
    assert cfg.zero_optimization.sub_group_size == 10**9  # honoured: the offload streaming window
    noted = " ".join(cfg._notes)
    assert "allgather_partitions" in noted
    assert cfg.prescale_gradients is False  # honoured (grads/grad_arithmetic.py), here at its default
    assert not cfg.tensorboard.enabled  # a monitoring section: honoured (zerodp.monitor), here switched off
