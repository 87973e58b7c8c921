"""VISSL's own config files (tests/configs/vissl, copied unchanged from facebookresearch/vissl) load as
VISSL means them: optimizer, LARC, param groups, precision, stage and learning-rate schedule."""

import math
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import zerodp
from zerodp.config import ConfigError, load_config
from zerodp.config.vissl import load_vissl, translate_vissl
from zerodp.config.vissl.defaults import VISSL_DEFAULTS
from zerodp.adapters.vissl.vissl_optimizer import vissl_lr_scheduler, vissl_optimizer, vissl_param_groups

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "vissl"
SWAV, SIMCLR = CONFIGS / "swav_8node_resnet.yaml", CONFIGS / "simclr_8node_resnet.yaml"
SEER = CONFIGS / "seer_regnet10B.yaml"
FULLTUNE, FULLTUNE_10B = CONFIGS / "fulltune_in1k_resnet.yaml", CONFIGS / "fulltune_in1k_regnet10B.yaml"


class TinyNet(nn.Module):
    """Conv + BN trunk, Linear head with bias, a LayerNorm and a bare parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 5)
        self.norm = nn.LayerNorm(5)
        self.class_token = nn.Parameter(torch.zeros(5))


def _vissl_defaults_from_file() -> dict:
    return yaml.safe_load((CONFIGS / "defaults.yaml").read_text())["config"]


def _walk(expected: dict, actual: dict, path: str = "") -> None:
    for key, value in expected.items():
        if isinstance(value, dict):
            _walk(value, actual[key], f"{path}{key}.")
        else:
            got = actual[key]
            if isinstance(value, float) or isinstance(got, float):
                assert float(got) == pytest.approx(float(value)), f"{path}{key}"
            else:
                assert got == value, f"{path}{key}"


def test_embedded_defaults_match_vissl_defaults_yaml():
    _walk(VISSL_DEFAULTS, _vissl_defaults_from_file())


def test_swav_optimizer_larc_groups_and_schedule():
    setup = load_vissl(SWAV)
    opt = setup.optimizer
    assert opt["name"] == "sgd" and opt["momentum"] == 0.9 and opt["nesterov"] is False
    assert opt["weight_decay"] == 1e-6
    assert opt["larc"] == {"clip": False, "trust_coefficient": 0.001, "eps": 1e-8}
    assert setup.zero_config["fp16"]["enabled"] and setup.zero_config["fp16"]["loss_scale"] == 0.0  # apex O1, dynamic
    assert setup.zero_config["zero_optimization"]["stage"] == 0  # plain DDP in the file
    assert setup.num_epochs == 400 and setup.update_interval == "step"
    # SwAV's README: batch 4096 (64 x 64 GPUs), lr 4.8 after a linear warmup from 0.6 (per-node scaled
    # 0.3 x 512/256) over 2.5% of training, then cosine (on the global fraction, 'fixed') down to 0.0048.
    steps_per_epoch = 10
    model = TinyNet()
    optimizer = vissl_optimizer(setup, model)
    schedule = vissl_lr_scheduler(setup, optimizer, steps_per_epoch)
    total = 400 * steps_per_epoch
    assert schedule.lr_at(0) == pytest.approx(0.6)
    assert schedule.lr_at(50) == pytest.approx(0.6 + (4.8 - 0.6) * 50 / 100)  # halfway through the warmup
    cos = lambda w: 0.0048 + 0.5 * (4.8 - 0.0048) * (1 + math.cos(math.pi * w))
    assert schedule.lr_at(100) == pytest.approx(cos(100 / total))
    assert schedule.lr_at(total - 1) == pytest.approx(cos((total - 1) / total))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.6)
    for _ in range(50):
        schedule.step()
    assert all(g["lr"] == pytest.approx(schedule.lr_at(50)) for g in optimizer.param_groups)
    assert isinstance(optimizer, zerodp.optim.LARC) and optimizer.settings == opt["larc"]


def test_param_groups_follow_vissl_regularize_rules():
    model = TinyNet()
    # regularize_bn True, regularize_bias True (SwAV): everything decays
    reg, unreg = vissl_param_groups(model, True, True, [], False)
    assert len(reg) == 8 and unreg == []
    # VISSL's defaults: regularize_bn False -> BN and LayerNorm weight and bias without decay
    reg, unreg = vissl_param_groups(model, False, True, [], False)
    assert {id(p) for p in unreg} == {id(model.bn.weight), id(model.bn.bias), id(model.norm.weight),
                                      id(model.norm.bias)}
    # regularize_bias False: the Linear bias and (with regularize_bn) the norm biases lose decay
    reg, unreg = vissl_param_groups(model, True, False, ["class_token"], False)
    assert {id(p) for p in unreg} == {id(model.head.bias), id(model.bn.bias), id(model.norm.bias),
                                      id(model.class_token)}
    # the fine-tuning file: regularize_bn False, weight decay 0, nesterov, multistep by epoch
    setup = load_vissl(FULLTUNE)
    optimizer = vissl_optimizer(setup, model)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.0]
    assert len(optimizer.param_groups[1]["params"]) == 4
    assert optimizer.defaults["nesterov"] is True and optimizer.defaults["momentum"] == 0.9
    # auto scaling: 32 x 1 node x 8 = 256 = base batch, so the values stay [0.1, ..., 1e-5] at epochs 30/60/90/100
    schedule = vissl_lr_scheduler(setup, optimizer, steps_per_epoch=3)
    assert [schedule.lr_at(e * 3) for e in (0, 29, 30, 59, 60, 90, 100, 104)] == pytest.approx(
        [0.1, 0.1, 0.01, 0.01, 0.001, 1e-4, 1e-5, 1e-5])
    assert schedule.lr_at(3 * 30 - 1) == pytest.approx(0.1)  # epoch interval: constant within epoch 29


def test_sdp_and_nested_form():
    setup = load_vissl(SIMCLR, overrides=["config.MODEL.SHARDED_DDP_SETUP.USE_SDP=True",
                                          "config.MODEL.SHARDED_DDP_SETUP.reduce_buffer_size=4096"])
    assert setup.zero_config["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 4096}
    assert "fp16" not in setup.zero_config  # SimCLR's file trains in fp32
    nested = {"OPTIMIZER": {"name": "zero", "base_optimizer": {"name": "sgd", "use_larc": True, "momentum": 0.8},
                            "param_schedulers": {"lr": {"name": "step", "values": [1.0, 0.5], "update_interval":
                                                        "epoch"}}, "num_epochs": 4}}
    setup = load_vissl(nested)
    assert setup.zero_config["zero_optimization"]["stage"] == 1
    assert setup.optimizer["momentum"] == 0.8 and setup.optimizer["weight_decay"] == 1e-4
    assert setup.optimizer["larc"] == {"clip": False, "trust_coefficient": 0.001, "eps": 1e-8}  # VISSL's defaults
    schedule = vissl_lr_scheduler(setup, torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0), steps_per_epoch=2)
    assert [schedule.lr_at(s) for s in range(8)] == [1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5]


def test_constant_and_composite_rescaled():
    spec = {"OPTIMIZER": {"num_epochs": 1, "param_schedulers": {"lr": {
        "name": "composite", "update_interval": "step", "interval_scaling": ["rescaled", "rescaled"],
        "lengths": [0.5, 0.5], "schedulers": [{"name": "constant", "value": 0.2},
                                              {"name": "linear", "start_value": 1.0, "end_value": 0.0}]}}}}
    setup = load_vissl(spec)
    schedule = vissl_lr_scheduler(setup, torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0), steps_per_epoch=4)
    assert [schedule.lr_at(s) for s in range(4)] == pytest.approx([0.2, 0.2, 1.0, 0.5])


def test_fsdp_files_give_stage3_and_precision():
    # SEER as VISSL composes it: the SwAV base, then the regnet10B overlay (hydra order)
    setup = load_vissl([SWAV, SEER])
    zero = setup.zero_config
    assert zero["zero_optimization"] == {"stage": 3, "stage3_unit_min_params": 100_000_000,
                                         "stage3_param_persistence_threshold": 0}  # AUTO_WRAP_THRESHOLD
    assert zero["fp16"]["enabled"]  # mixed_precision with compute_dtype float16
    assert zero["train_micro_batch_size_per_gpu"] == 16
    assert setup.optimizer["single_group"] and setup.optimizer["weight_decay"] == 1e-5
    # 16 x 62 nodes x 8 = 7936 -> lr 0.3 x 7936 / 256 = 9.3; the overlay's lengths replace the base's
    assert setup.lr_schedule_spec["lengths"] == [0.043648, 0.956352]
    assert setup.schedule_value(0.05) == pytest.approx(0.0093 + 0.5 * (9.3 - 0.0093) * (1 + math.cos(math.pi * 0.05)))
    assert "flatten_parameters=False" in setup.report
    fine = load_vissl(FULLTUNE_10B)
    assert fine.zero_config["zero_optimization"]["stage"] == 3 and fine.optimizer["larc"] is None
    fp32 = load_vissl(SWAV, overrides=["config.MODEL.FSDP_CONFIG.compute_dtype=float32",
                                       "config.MODEL.AMP_PARAMS.USE_AMP=False"])
    assert fp32.zero_config["zero_optimization"]["stage"] == 3 and "fp16" not in fp32.zero_config


def test_report_names_read_and_ignored_sections(caplog):
    with caplog.at_level("INFO", logger="zerodp"):
        load_vissl(SWAV)
    text = caplog.text
    assert "zerodp read OPTIMIZER" in text and "MODEL.AMP_PARAMS" in text
    for section in ("LOSS", "MODEL.TRUNK", "MODEL.HEAD", "MACHINE", "CHECKPOINT"):
        assert section in text.split("ignored")[1]
    assert text.count("zerodp read") == 1


def test_errors_name_the_key_and_fix(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'regularize_bn'"):
        load_vissl(SWAV, overrides=["config.OPTIMIZER.regularise_bn=True"])
    with pytest.raises(ConfigError, match="did you mean 'trust_coefficient'"):
        load_vissl(SWAV, overrides=["config.OPTIMIZER.larc_config.trust_coeficient=0.1"])
    with pytest.raises(ConfigError, match="did you mean 'USE_SDP'"):
        load_vissl({"MODEL": {"SHARDED_DDP_SETUP": {"USE_SPD": True}}})
    with pytest.raises(ConfigError, match="did you mean 'interval_scaling'"):
        load_vissl(SWAV, overrides=["config.OPTIMIZER.param_schedulers.lr.interval_scalling=[fixed,fixed]"])
    with pytest.raises(ConfigError, match="param_group_constructor 'dino'"):
        load_vissl(CONFIGS / "dino_16gpus_deits16_fsdp.yaml")
    with pytest.raises(ConfigError, match="both ShardedDDP"):
        load_vissl(FULLTUNE_10B, overrides=["config.MODEL.SHARDED_DDP_SETUP.USE_SDP=True"])
    with pytest.raises(ConfigError, match="lengths must sum to 1"):
        load_vissl(SWAV, overrides=["config.OPTIMIZER.param_schedulers.lr.lengths=[0.5,0.6]"])
    # zerodp.initialize reads no VISSL file (its adapter translates it): the error says how
    path = tmp_path / "swav.yaml"
    path.write_text(SWAV.read_text())
    with pytest.raises(ConfigError, match="steps_per_epoch"):
        zerodp.initialize(TinyNet(), None, str(path))
    # translated for load_config (no model): one group at the schedule's first lr
    cfg = load_config(translate_vissl(path))
    assert cfg.optimizer.params["lr"] == pytest.approx(0.6) and cfg.fp16.enabled


def test_former_module_path_still_imports():
    """`zerodp.config_vissl` (the dialect's path before it became the `zerodp.config.vissl` package) still works."""
    import zerodp.config_vissl

    assert zerodp.config_vissl.load_vissl is load_vissl
