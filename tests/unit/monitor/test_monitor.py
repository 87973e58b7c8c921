"""DeepSpeed's monitoring sections at world size 1 (no process group): the config sections DeepSpeed
documents load, missing packages are refused with the command to run, wandb gets DeepSpeed's calls,
flops_profiler's FLOPs of a Linear stack equal the closed form, comms_logger counts what comm.record()
sees, and a switched-off monitor costs nothing (no observer on the collectives).
(The 2-rank runs of every monitor are in tests/dist/test_monitor.py.)"""

from __future__ import annotations

import csv
import logging
import sys
import types

import pytest
import torch
from torch import nn

import zerodp
import zerodp.deepspeed as deepspeed
from zerodp import comm
from zerodp.comm import collectives
from zerodp.config import load_config
from zerodp.errors import ConfigError

# The examples of DeepSpeed's config reference, unchanged (microsoft/DeepSpeed docs/_pages/config-json.md at
# 38327e07f), and sections from public training scripts (sources noted).
DEEPSPEED_DOC_SECTIONS = {
    "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 1, "detailed": True,
                       "output_file": None},
    "tensorboard": {"enabled": True, "output_path": "output/ds_logs/", "job_name": "train_bert"},
    "wandb": {"enabled": True, "group": "my_group", "team": "my_team", "project": "my_project"},
    "csv_monitor": {"enabled": True, "output_path": "output/ds_logs/", "job_name": "train_bert"},
    "comms_logger": {"enabled": True, "verbose": False, "prof_all": False, "debug": False,
                     "prof_ops": ["all_reduce", "all_gather"]},
}
# A Megatron-DeepSpeed launch script for ALCF Polaris (a public fork): profile_step -1 means never.
MEGATRON_DS_FLOPS = {"enabled": True, "profile_step": -1, "module_depth": -1, "top_modules": 1, "detailed": True,
                     "output_file": None}


def test_deepspeed_documented_sections_load():
    cfg = load_config(DEEPSPEED_DOC_SECTIONS)
    assert cfg.tensorboard.enabled and cfg.tensorboard.output_path == "output/ds_logs/"
    assert cfg.tensorboard.job_name == "train_bert"
    assert (cfg.wandb.group, cfg.wandb.team, cfg.wandb.project) == ("my_group", "my_team", "my_project")
    assert cfg.comms_logger.prof_ops == ["all_reduce", "all_gather"] and not cfg.comms_logger.prof_all
    assert cfg.flops_profiler.profile_step == 1 and cfg.flops_profiler.output_file is None
    assert load_config({"flops_profiler": MEGATRON_DS_FLOPS}).flops_profiler.profile_step == -1
    assert not load_config({}).csv_monitor.enabled  # every section is off by default


@pytest.mark.parametrize("config, fragment", [
    ({"csv_monitor": {"enabled": True, "output_dir": "x"}}, "did you mean 'output_path'"),
    ({"comms_logger": {"enabled": True, "prof_ops": ["all_reduec"]}}, "'all_reduec' is not a collective"),
    ({"flops_profiler": {"enabled": True, "profile_step": -2}}, "profile_step"),
])
def test_bad_monitor_keys_are_named(config, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(config)


def test_enabled_auto_means_off():
    cfg = load_config({"tensorboard": {"enabled": "auto"}, "flops_profiler": {"enabled": "auto"}})
    assert not cfg.tensorboard.enabled and not cfg.flops_profiler.enabled
    assert any("tensorboard.enabled='auto' means off" in note for note in cfg._notes)


def _stack(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 3)))


WIDTHS = [(6, 10), (10, 8), (8, 3)]


def _train(engine, steps: int, rows: int, gas: int, losses: list | None = None) -> None:
    g = torch.Generator().manual_seed(3)
    for _ in range(steps * gas):
        loss = engine(torch.randn(rows, 6, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if losses is not None:
            losses.append(loss.detach())


@pytest.mark.parametrize("profile_step", [0, 2])
def test_flops_of_a_linear_stack_equal_the_closed_form(profile_step, caplog):
    rows, gas = 5, 2
    engine = zerodp.initialize(_stack(), None, {
        "train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "flops_profiler": {"enabled": True, "profile_step": profile_step, "module_depth": 1, "top_modules": 2}})
    with caplog.at_level(logging.INFO, logger="zerodp"):
        _train(engine, profile_step + 2, rows, gas)
    report = engine.monitor.flops_profiler.report
    forward = 2 * rows * gas * sum(i * o for i, o in WIDTHS)
    # backward: weight gradients of every layer, input gradients of all but the first (its input needs none)
    backward = 2 * rows * gas * (sum(i * o for i, o in WIDTHS) + sum(i * o for i, o in WIDTHS[1:]))
    assert (report.step, report.micro_steps) == (profile_step, gas)
    assert (report.forward_flops, report.backward_flops, report.total_flops) == (forward, backward, forward + backward)
    assert report.outside_flops == 0
    assert report.module_flops["Sequential.0"] == 3 * 2 * rows * gas * 6 * 10 - 2 * rows * gas * 6 * 10
    assert engine.monitor.flops_profiler.get_total_flops() == forward + backward
    text = "\n".join(r.getMessage() for r in caplog.records if "flops profiler" in r.getMessage())
    assert f"({forward + backward} FLOPs)" in text
    assert "depth 1: Sequential.2 " in text and "depth 2" not in text  # module_depth 1, two per level
    engine.close()


def test_tensorboard_missing_is_one_line_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard raises ImportError
    with pytest.raises(ConfigError, match="pip install tensorboard") as info:
        zerodp.initialize(_stack(), None, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                           "tensorboard": {"enabled": True}})
    assert "\n" not in str(info.value)


def test_wandb_missing_is_refused_and_present_gets_deepspeeds_calls(monkeypatch, tmp_path):
    config = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "train_micro_batch_size_per_gpu": 4,
              "wandb": {"enabled": True, "group": "g", "team": "t", "project": "p"}}
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match="pip install wandb"):
        zerodp.initialize(_stack(), None, config)

    calls = []  # a stand-in module recording what zerodp calls (wandb is never a dependency)
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or types.SimpleNamespace(finish=lambda: calls.append("finish"))
    fake.log = lambda data, step=None: calls.append(("log", data, step))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    engine = zerodp.initialize(_stack(), None, config)
    _train(engine, 2, 4, 1)
    engine.close()
    assert calls[0] == ("init", {"project": "p", "group": "g", "entity": "t"}) and calls[-1] == "finish"
    logged = [c for c in calls if c[0] == "log"]
    assert [(list(d), step) for _, d, step in logged[:3]] == [
        (["Train/Samples/train_loss"], 4), (["Train/Samples/lr"], 4), (["Train/Samples/grad_norm"], 4)]
    assert {step for *_, step in logged} == {4, 8}


def test_csv_resume_appends_without_a_second_header(tmp_path):
    config = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "train_micro_batch_size_per_gpu": 4,
              "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}}
    for _ in range(2):
        losses: list = []
        engine = zerodp.initialize(_stack(), None, config)
        _train(engine, 2, 4, 1, losses)
        engine.close()
    with open(tmp_path / "run" / "Train_Samples_train_loss.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"] and len(rows) == 1 + 4
    assert [float(v) for _, v in rows[3:]] == [float(loss) for loss in losses]  # the second run's losses


@pytest.mark.parametrize("debug", [False, True])
def test_comms_logger_counts_what_record_sees(debug):
    engine = zerodp.initialize(_stack(), None, {
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 1},
        "comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["all_gather_into_tensor"], "debug": debug}})
    with comm.record() as recorded:
        _train(engine, 2, 4, 1)
    summary = engine.monitor.comms_logger.summary()
    gathers = recorded.of("all_gather")
    assert gathers and len(recorded.records) > len(gathers)  # other collectives ran, and were not logged
    if debug:
        assert set(summary) == {f"all_gather [{tag}]" for tag in {r.tag for r in gathers}}
    else:
        assert set(summary) == {"all_gather"}
    assert sum(s.count for rows in summary.values() for s in rows.values()) == len(gathers)
    assert sum(s.nbytes for rows in summary.values() for s in rows.values()) == sum(r.nbytes for r in gathers)
    assert engine.comms_summary().count("all_gather") == len(summary)
    assert deepspeed.comm.log_summary() == engine.comms_summary()  # DeepSpeed's call
    engine.close()
    with pytest.raises(RuntimeError, match="no comms logger is running"):
        deepspeed.comm.log_summary()
    assert engine.monitor.comms_logger is None and not collectives.observers()


def test_switched_off_monitor_adds_nothing():
    engine = zerodp.initialize(_stack(), None, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert engine.monitor.writers == [] and engine.monitor.comms_logger is None
    assert engine.monitor.flops_profiler is None and not collectives.observers()
    assert engine.comms_summary() == ""
    engine.close()


def test_comms_logger_verbose_logs_each_collective(caplog):
    engine = zerodp.initialize(_stack(), None, {
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "train_micro_batch_size_per_gpu": 4,
        "comms_logger": {"enabled": True, "verbose": True}})
    with comm.record() as recorded, caplog.at_level(logging.INFO, logger="zerodp"):
        _train(engine, 2, 4, 1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("zerodp comm: ")]
    assert len(lines) == len(recorded.records) > 0
    assert all(" during global step " in line for line in lines)
    engine.close()
