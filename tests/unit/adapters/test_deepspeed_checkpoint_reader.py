"""DeepSpeed's checkpoints through zerodp's other doors (issue 40, part 1): ZeroEngine's own load and save (not only
the adapter's, tests/dist/test_deepspeed_resume.py), the adapter's get_fp32_state_dict_from_zero_checkpoint, and
`zerodp train --resume`'s check of the folder. One process, the DeepSpeed fixtures of tests/fixtures/deepspeed_ckpt."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import zerodp
from tests.dist.common import make_model, micro_batch, param_groups
from zerodp.checkpoint.deepspeed_pickle import load_deepspeed_file
from zerodp.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_ckpt"
EXPECTED = torch.load(FIXTURES / "expected.pt", weights_only=True)


def _zero_engine(case: dict, stage: int):
    """ZeroEngine (zerodp.initialize) on one rank with the fixture's config: 4 micro-batches make its global batch."""
    config = {**case["config"], "zero_optimization": {"stage": stage}, "gradient_accumulation_steps": 4}
    model = make_model(123)
    return zerodp.initialize(model, torch.optim.AdamW(param_groups(model, 1e-2), lr=EXPECTED["lr"]), config)


def test_zero_engine_resumes_a_deepspeed_checkpoint_as_deepspeed_does():
    """Stage-3 fp32 checkpoint of 2 DeepSpeed ranks, resumed by ZeroEngine at world size 1 and stage 2."""
    case = EXPECTED["cases"]["s3_fp32"]
    engine = _zero_engine(case, stage=2)
    client = engine.load_checkpoint(FIXTURES / "s3_fp32")
    assert client["client"] == {"epoch": 7, "name": "s3_fp32"} and engine.global_step == 3
    losses, lrs = [], []
    for step in range(3, 6):
        lrs.append(engine.get_lr()[0])
        total = 0.0
        for micro in range(4):
            x, y = micro_batch(step, micro, 0, 1, 2, 4)
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / 4
        losses.append(total)
    assert lrs == pytest.approx(case["lrs"], rel=1e-12)
    # fp32, another summation order (one rank): rtol 1e-5 as in tests/dist/common.py
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(case["losses"]), rtol=1e-5, atol=0)
    params = engine.full_state_dict()
    for key in ("embed.weight", "hidden.weight", "gain", "frozen.weight", "out.bias"):
        torch.testing.assert_close(params[key], case["params"][f"master.{key}"] if f"master.{key}" in case["params"]
                                   else case["params"][key], rtol=1e-5, atol=1e-6)
    engine.close()


# tolerance against the universal folder's values: s2_fp32 is its source (exact); s1/s3 fp32 trained the same steps
# with another reduction order (fp32 rounding); s2_bf16 trained in bf16 (values within a few bf16 roundings)
TOLERANCES = {"s2_fp32": (0, 0), "s1_fp32": (1e-5, 1e-7), "s3_fp32": (1e-5, 1e-7), "s2_bf16": (0, 4e-3)}


@pytest.mark.parametrize("name", sorted(TOLERANCES))
def test_fp32_state_dict_of_a_deepspeed_checkpoint(name):
    """The adapter's get_fp32_state_dict_from_zero_checkpoint reads DeepSpeed's files: the trainable weights equal
    what DeepSpeed's ds_to_universal extracted (the universal fixture, made from s2_fp32; see TOLERANCES)."""
    state = get_fp32_state_dict_from_zero_checkpoint(FIXTURES / name)
    assert list(state) == [n for n, _ in make_model().state_dict().items()]
    universal = FIXTURES / "universal" / "global_step3" / "zero"
    for key, value in state.items():
        expected = load_deepspeed_file(universal / key / "fp32.pt")["param"]
        rtol, atol = TOLERANCES[name]
        torch.testing.assert_close(value, expected.reshape(value.shape).float(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{key}: {m}")
    assert state["frozen.weight"].dtype == torch.float32


def test_zerodp_train_resume_accepts_a_deepspeed_folder(tmp_path):
    from zerodp.tools.app.train_args import UsageError, _check_resumable

    _check_resumable(FIXTURES / "s2_fp32", None)  # found and accepted; the model is checked at the load
    _check_resumable(FIXTURES / "universal", None)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("x")
    with pytest.raises(UsageError, match=r"--resume .*: .* is in none of the formats zerodp reads"):
        _check_resumable(tmp_path / "x", None)


def test_zero_engine_saves_deepspeed_layout_when_asked(tmp_path):
    case = EXPECTED["cases"]["s2_fp32"]
    engine = _zero_engine(case, stage=2)
    for micro in range(4):
        x, y = micro_batch(0, micro, 0, 1, 2, 4)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    path = Path(engine.save_checkpoint(tmp_path / "a", deepspeed_layout=True))
    engine.save_checkpoint(tmp_path / "b")
    assert (path / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file() and (path / "mp_rank_00_model_states.pt").is_file()
    assert not list((tmp_path / "b" / "global_step1").glob("*optim_states.pt"))  # only when asked
    script = Path(zerodp.checkpoint.deepspeed_zero_to_fp32.__file__)
    spec = importlib.util.spec_from_file_location("zero_to_fp32_copy", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    state = module.get_fp32_state_dict(tmp_path / "a")
    full = engine.full_state_dict()
    assert state.keys() == full.keys() and all(torch.equal(state[k], full[k]) for k in full)
    engine.close()


def test_adam_state_into_another_optimizer_is_refused():
    model = make_model(123)
    engine = zerodp.initialize(model, torch.optim.SGD(param_groups(model, 1e-2), lr=0.1, momentum=0.9),
                               {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})
    with pytest.raises(zerodp.CheckpointError, match=r"holds Adam's moments \(exp_avg, exp_avg_sq\), but the engine's "
                                                     r"optimizer is torch.optim.sgd.SGD; resume with an Adam\(W\)"):
        engine.load_checkpoint(FIXTURES / "s2_fp32")
    engine.close()


class _UserState:  # an object of the user's own in a client state
    def __init__(self) -> None:
        self.epoch = 7


def test_user_objects_in_deepspeed_pickles_need_allowing(tmp_path):
    """DeepSpeed's files are read weights-only: a user's class is refused, naming it, until allowlisted."""
    from zerodp.checkpoint.deepspeed_pickle import DeepSpeedRecord, DynamicLossScaler, save_deepspeed_file

    path = tmp_path / "mp_rank_00_model_states.pt"
    save_deepspeed_file({"scaler": DynamicLossScaler(8.0), "user": _UserState()}, path)
    with pytest.raises(zerodp.CheckpointError, match=r"_UserState.* torch.serialization.add_safe_globals"):
        load_deepspeed_file(path)
    with torch.serialization.safe_globals([_UserState]):
        loaded = load_deepspeed_file(path)
    assert loaded["user"].epoch == 7
    assert isinstance(loaded["scaler"], DeepSpeedRecord) and loaded["scaler"].cur_scale == 8.0  # never DeepSpeed's


def _deepspeed_grows(cur_iter: int, last_overflow_iter: int, window: int) -> bool:
    """DeepSpeed 0.19.8's rule (runtime/fp16/loss_scaler.py, DynamicLossScaler.update_scale) at a clean step."""
    stable = cur_iter - last_overflow_iter - 1
    return stable > 0 and stable % window == 0


@pytest.mark.parametrize("cur_iter,last_overflow_iter", [(3, -1), (7, 2), (10, 8), (5, 4)])
def test_loss_scaler_window_carries_over_from_deepspeed(cur_iter, last_overflow_iter):
    """After a load, zerodp's scale grows at the clean steps where DeepSpeed's would have (window 3)."""
    from types import SimpleNamespace

    from zerodp.checkpoint.deepspeed_pickle import DynamicLossScaler
    from zerodp.checkpoint.deepspeed_reader import loss_scaler_state
    from zerodp.precision.policy import LossScaler

    ds = DynamicLossScaler(1024.0)
    ds.__dict__.update(dynamic=True, cur_iter=cur_iter, last_overflow_iter=last_overflow_iter, cur_hysteresis=2)
    scaler = LossScaler(scale=1.0, dynamic=True, window=3, hysteresis=2)
    scaler.load_state_dict(loss_scaler_state({"loss_scaler": ds}, SimpleNamespace(scaler=scaler), 0))
    assert scaler.scale == 1024.0
    zerodp_growth, deepspeed_growth, it = [], [], cur_iter
    for _ in range(7):
        before = scaler.scale
        scaler.update(False)
        zerodp_growth.append(scaler.scale > before)
        deepspeed_growth.append(_deepspeed_grows(it, last_overflow_iter, 3))
        it += 1
    assert zerodp_growth == deepspeed_growth and any(zerodp_growth)


def test_adapter_checkpoint_format_zerodp_writes_no_deepspeed_weights(tmp_path):
    import zerodp.deepspeed as deepspeed
    from zerodp.config import ConfigError

    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model, 1e-2), lr=1e-2),
                                      config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})
    engine.save_checkpoint(tmp_path / "z", checkpoint_format="zerodp")
    index = torch.load(tmp_path / "z" / "global_step0" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    assert "single_partition_of_fp32_groups" not in index["optimizer_state_dict"]  # an index, no weights
    assert not (tmp_path / "z" / "zero_to_fp32.py").exists()
    engine.save_checkpoint(tmp_path / "d")  # the default: DeepSpeed's layout and the script too
    optim = load_deepspeed_file(tmp_path / "d" / "global_step0" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert optim["optimizer_state_dict"]["single_partition_of_fp32_groups"][0].numel() > 0
    script = tmp_path / "d" / "zero_to_fp32.py"
    spec = importlib.util.spec_from_file_location("zero_to_fp32_cli", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([str(tmp_path / "d"), str(tmp_path / "model_fp32.pt")])  # the documented command line
    weights = torch.load(tmp_path / "model_fp32.pt", weights_only=True)
    assert all(torch.equal(weights[k], v) for k, v in engine.full_state_dict().items())
    with pytest.raises(ConfigError, match="checkpoint_format='deepspeed'"):
        engine.save_checkpoint(tmp_path / "x", checkpoint_format="deepspeed")
    engine.destroy()


def test_adapter_at_stage_0_writes_zerodp_format_only(tmp_path):
    import zerodp.deepspeed as deepspeed

    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model, 1e-2), lr=1e-2),
                                      config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0}})
    engine.save_checkpoint(tmp_path / "s0")
    tag = tmp_path / "s0" / "global_step0"
    assert (tag / "meta.json").is_file() and not (tmp_path / "s0" / "zero_to_fp32.py").exists()
    index = torch.load(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    assert set(index["optimizer_state_dict"]) == {"zero_stage", "partition_count", "zerodp_shard"}
    engine.destroy()
