"""The DeepSpeed names Accelerate and the HF Trainer call beyond the training loop (issue 35), with DeepSpeed's
meaning, in process (one rank): `checkpoint.utils.clone_tensors_for_torch_save`, `utils.zero_to_fp32`,
`engine.zero_gather_16bit_weights_on_model_save()` / `_zero3_consolidated_16bit_state_dict()`, `engine.config` as
given, `set_gradient_accumulation_boundary` with an early boundary, `utils.set_z3_leaf_modules`, the parameter count
transformers takes at stage 3 (`p.ds_numel if hasattr(p, "ds_numel") else p.numel()`), and `comm.mori`'s refusal."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerodp.deepspeed as deepspeed
from zerodp.config import ConfigError
from zerodp.deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from zerodp.deepspeed.utils import set_z3_leaf_modules, z3_leaf_module
from zerodp.deepspeed.utils.zero_to_fp32 import (get_fp32_state_dict_from_zero_checkpoint,
                                                 load_state_dict_from_zero_checkpoint)
from tests.oracle import train_reference


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _engine(stage: int, model=None, **zero):
    model = model or _model()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},  # torch AdamW's
              "zero_optimization": {"stage": stage, **zero}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, config


def _train(engine, steps=2):
    for k in range(steps * 2):
        g = torch.Generator().manual_seed(k)
        engine.backward(F.mse_loss(engine(torch.randn(2, 6, generator=g)), torch.randn(2, 3, generator=g)))
        engine.step()


def test_clone_tensors_for_torch_save_copies_each_tensor_to_its_own_storage():
    flat = torch.arange(6.0)
    state = OrderedDict(a=flat[:2], b=[flat[2:4], (flat[4:],)], n=3)
    out = clone_tensors_for_torch_save(state)
    assert type(out) is OrderedDict and out["n"] == 3 and isinstance(out["b"][1], tuple)
    assert out["a"].untyped_storage().nbytes() == 2 * 4  # its own storage, not the flat buffer's
    torch.testing.assert_close(out["b"][1][0], flat[4:])
    out["a"].add_(1)
    assert flat[0] == 0


def test_engine_config_is_the_config_as_given_and_zero_config_is_zerodps():
    engine, config = _engine(2)
    assert engine.config is config and engine.config.get("zero_optimization")["stage"] == 2  # transformers reads it
    assert engine.zero_config.stage == 2
    engine.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_fp32_reads_the_whole_fp32_model_of_a_checkpoint(tmp_path, stage):
    engine, _ = _engine(stage)
    _train(engine)
    engine.save_checkpoint(tmp_path)
    want = engine.full_state_dict(rank0_only=False)
    got = get_fp32_state_dict_from_zero_checkpoint(tmp_path)  # the latest tag, as DeepSpeed
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    model = load_state_dict_from_zero_checkpoint(_model(), tmp_path, tag="global_step2")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0)
    engine.destroy()


def test_consolidated_16bit_state_dict_at_stage_3_and_the_save_flag():
    engine, _ = _engine(3, stage3_gather_16bit_weights_on_model_save=True)
    _train(engine)
    assert engine.zero_gather_16bit_weights_on_model_save() is True
    state = engine._zero3_consolidated_16bit_state_dict()
    want = engine.full_state_dict(rank0_only=False)
    assert list(state) == list(want)
    for k in want:
        torch.testing.assert_close(state[k], want[k], rtol=0, atol=0)  # fp32 run: the compute dtype is fp32
    engine.destroy()
    below, _ = _engine(2)
    assert below.zero_gather_16bit_weights_on_model_save() is False
    with pytest.raises(ValueError, match="requires ZeRO-3 mode"):
        below._zero3_consolidated_16bit_state_dict()
    below.destroy()


def test_an_early_boundary_steps_the_partial_accumulation():
    """Accelerate ends an epoch's last accumulation early (sync_gradients at the loader's end): one micro-batch, then
    the boundary; the step uses that micro-batch's gradient divided by the accumulation steps, as DeepSpeed does."""
    ref = _model()
    x, y = torch.randn(2, 6, generator=torch.Generator().manual_seed(7)), torch.randn(2, 3)
    # one step of a 2-step accumulation whose second micro-batch never comes: its gradient divided by 2
    train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=0.05), 1, lambda m, step: F.mse_loss(m(x), y) / 2)
    engine, _ = _engine(2)
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    assert engine.global_steps == 1 and engine.engine.at_step_boundary  # a checkpoint may be saved here
    state = engine.full_state_dict(rank0_only=False)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-6, atol=1e-7)
    engine.destroy()


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        return sum(e(x) for e in self.experts)


def test_set_z3_leaf_modules_gathers_each_leaf_whole():
    def moe():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), Experts(), nn.Linear(8, 3))

    model = moe()
    assert set_z3_leaf_modules(model, [Experts]) == [model[1]] and z3_leaf_module(model[1])
    engine, _ = _engine(3, model=model, stage3_unit_min_params=1, stage3_param_persistence_threshold=0)
    names = {u.module_name for u in engine.engine.units}
    assert "1" in names and not any(n.startswith("1.") for n in names), names  # no unit below the leaf
    assert engine.zero_config.zero_optimization.stage3_unit_modules == ["Experts"]
    engine.destroy()
    plain, _ = _engine(3, model=moe(), stage3_unit_min_params=1, stage3_param_persistence_threshold=0)
    assert any(u.module_name.startswith("1.") for u in plain.engine.units)  # without it, experts are units
    plain.destroy()
    inner = moe()
    set_z3_leaf_modules(inner, ["Experts"])
    with pytest.raises(ConfigError, match="sit inside modules set as stage-3 leaves"):
        _engine(3, model=inner, stage3_unit_modules=["Linear"])


def test_transformers_parameter_count_at_stage_3_is_the_whole_model():
    from transformers.trainer_pt_utils import get_model_param_count

    model = _model()
    whole = sum(p.numel() for p in model.parameters())
    engine, _ = _engine(3, model=model, stage3_param_persistence_threshold=0)
    # zerodp's partitioned parameters keep their shapes and carry no ds_numel: numel() is the whole count
    assert all(not hasattr(p, "ds_numel") for p in model.parameters())
    assert get_model_param_count(engine.module) == whole
    engine.destroy()


def test_comm_mori_is_refused_naming_it():
    with pytest.raises(ImportError, match="mori .* not provided by zerodp.deepspeed: zerodp is data parallel only"):
        from zerodp.deepspeed.comm import mori  # noqa: F401


def test_gathered_parameters_takes_accelerates_fwd_module_and_enabled():
    """accelerate.utils.GatheredParameters passes `fwd_module=` and `enabled=` through: enabled=False gathers
    nothing (reading the partitioned weight is refused, naming it), enabled=True gathers; fwd_module changes
    nothing in zerodp (DeepSpeed registers the parameters as the module's external ones; zerodp's units need no
    registration)."""
    from zerodp.errors import PartitionedParameterError

    engine, _ = _engine(3, stage3_param_persistence_threshold=0)
    weight = engine.module[0].weight
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=0, fwd_module=engine.module, enabled=False):
        with pytest.raises(PartitionedParameterError, match="partitioned across ranks"):
            weight.sum()
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=0, fwd_module=engine.module, enabled=True):
        torch.testing.assert_close(weight.detach().clone(), _model()[0].weight.detach(), rtol=0, atol=0)
    engine.destroy()


def test_steps_per_print_inf_is_never_and_valid_lr_schedules_are_deepspeeds():
    """Accelerate writes `steps_per_print: inf` into every config (DeepSpeed's "never") and reads
    `runtime.lr_schedules.VALID_LR_SCHEDULES` to decide which scheduler goes to initialize."""
    from zerodp.config import load_config
    from zerodp.deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES, WarmupLR

    assert load_config({"steps_per_print": float("inf")}).steps_per_print is None
    with pytest.raises(ConfigError):
        load_config({"steps_per_print": float("nan")})  # any other non-finite number stays refused
    assert VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert WarmupLR.__name__ in VALID_LR_SCHEDULES
