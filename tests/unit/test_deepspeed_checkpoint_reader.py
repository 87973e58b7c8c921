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

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_ckpt"
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
    from zerodp.app.train_args import UsageError, _check_resumable

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
