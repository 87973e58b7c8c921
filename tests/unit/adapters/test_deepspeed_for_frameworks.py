"""What frameworks call on DeepSpeed beyond a training script (zerodp/adapters/deepspeed): the optimizer
`initialize` returns (`zero_grad`, `state`, `param_groups`, `state_dict`, as PyTorch Lightning uses them),
a settable `engine.lr_scheduler`, the DeepSpeed-named files of a checkpoint that Lightning's
`convert_zero_checkpoint_to_fp32_state_dict` opens, and `deepspeed.launcher.runner` (accelerate launch).
The adapter wraps a stand-in for zerodp's engine here (no process group); tests/e2e/test_lightning.py
runs Lightning itself."""

from __future__ import annotations

import os

from types import SimpleNamespace

import pytest
import torch

from zerodp.deepspeed.checkpoint_files import write_deepspeed_files
from zerodp.deepspeed.engine import DeepSpeedEngine
from zerodp.deepspeed.utils.zero_to_fp32 import get_model_state_file, get_optim_files


def _adapter(at_step_boundary: bool = True):
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    inner.step()
    zero = SimpleNamespace(module=model, optimizer=SimpleNamespace(optimizer=inner, param_groups=inner.param_groups,
                                                                   last_grad_norm=1.5),
                           lr_scheduler="engine-owned", train_batch_size=4, at_step_boundary=at_step_boundary)
    return DeepSpeedEngine(zero), zero, inner


def test_the_returned_optimizer_has_what_lightning_reads():
    engine, zero, inner = _adapter()
    optimizer = engine.optimizer
    assert optimizer.state is inner.state and optimizer.param_groups is inner.param_groups
    assert optimizer.optimizer is inner and optimizer.last_grad_norm == 1.5  # the rest is zerodp's optimizer
    assert optimizer.state_dict()["state"][0]["exp_avg"].shape == (2, 3)
    optimizer.zero_grad()  # between steps: gradients were zeroed by the engine's step, nothing to do
    with pytest.raises(RuntimeError, match="call engine.step"):
        optimizer.step()
    with pytest.raises(RuntimeError, match="restored by engine.load_checkpoint"):
        optimizer.load_state_dict({})


def test_zero_grad_inside_an_accumulation_window_is_refused():
    engine, _, _ = _adapter(at_step_boundary=False)
    with pytest.raises(RuntimeError, match="inside a gradient accumulation window would drop the gradients"):
        engine.optimizer.zero_grad()


def test_lr_scheduler_is_settable_as_lightning_sets_it():
    engine, zero, _ = _adapter()
    assert engine.lr_scheduler == "engine-owned"
    engine.lr_scheduler = None  # Lightning: the engine stops stepping it; Lightning steps it itself
    assert zero.lr_scheduler is None and engine.lr_scheduler is None


def test_deepspeed_named_checkpoint_files_carry_the_stage_and_the_client_state(tmp_path):
    write_deepspeed_files(tmp_path, zero_stage=3, world_size=2, global_steps=7, skipped_steps=1,
                          client_state={"epoch": 2, "loops": {"x": 1}})
    files = get_optim_files(tmp_path)
    assert [f.rsplit("/", 1)[1] for f in files] == ["zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                     "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    index = torch.load(files[1], weights_only=False)
    assert index["optimizer_state_dict"] == {"zero_stage": 3, "partition_count": 2,
                                             "zerodp_shard": "shard-00001-of-00002.safetensors"}
    states = torch.load(get_model_state_file(tmp_path, 3), weights_only=False)
    assert states["epoch"] == 2 and states["loops"] == {"x": 1} and states["global_steps"] == 7
    with pytest.raises(FileNotFoundError, match="mp_rank_00_model_states.pt does not exist"):
        get_model_state_file(tmp_path, 2)  # stages 0-2 have DeepSpeed's other name
    with pytest.raises(FileNotFoundError, match="no '\\*_optim_states.pt' files"):
        get_optim_files(tmp_path / "elsewhere")


def test_launcher_runner_has_what_accelerate_reads_and_is_deepspeeds_command(monkeypatch, tmp_path):
    from zerodp.adapters.deepspeed.launcher import runner

    assert runner.DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"  # DS_ENV_FILE unset here
    assert runner.DEEPSPEED_ENVIRONMENT_PATHS == [os.path.expanduser("~"), "."]
    # DeepSpeed's command (tests/unit/adapters/test_deepspeed_launcher.py, tests/e2e/test_deepspeed_launcher.py); a
    # bad input stops it before anything starts
    with pytest.raises(SystemExit, match=f"zerodp-deepspeed: error: --hostfile {tmp_path}/h: no such file"):
        runner.main(["--hostfile", str(tmp_path / "h"), "train.py"])
