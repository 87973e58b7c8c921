"""Config: DeepSpeed's keys, VISSL's dialect, and errors that name the key and the fix."""

import json

import pytest

from zerodp.config.vissl import translate_vissl
from zerodp.config import ConfigError, ZeroConfig, load_config, reference_markdown

DEEPSPEED_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.01, "torch_adam": True}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8,
                          "overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True},
    "steps_per_print": 10,
}


def test_deepspeed_config_is_accepted_unchanged(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DEEPSPEED_CONFIG))
    cfg = load_config(str(path))
    assert cfg.stage == 2 and cfg.fp16.enabled and cfg.fp16.initial_scale_power == 12
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.optimizer.type == "AdamW"
    assert cfg.resolve_batch(world_size=4) == (32, 4, 2)


def test_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("zero_optimization:\n  stage: 1\nbf16:\n  enabled: true\n")
    cfg = load_config(path)
    assert cfg.stage == 1 and cfg.bf16.enabled


@pytest.mark.parametrize("bad, fragment", [
    ({"zero_optimisation": {"stage": 1}}, "did you mean 'zero_optimization'"),
    ({"zero_optimization": {"stag": 1}}, "did you mean 'stage'"),
    ({"fp16": {"enabeld": True}}, "did you mean 'enabled'"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage: Input should be less than or equal to 3"),
    ({"gradient_clipping": -1}, "gradient_clipping: Input should be greater than or equal to 0"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enable at most one"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "offload_optimizer needs stage 1, 2 or 3"),
])
def test_bad_keys_and_values_name_the_problem(bad, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert fragment in str(err.value)


def test_contiguous_gradients_false_is_accepted_with_a_warning():
    """DeepSpeed's false keeps gradients in separate tensors (same values); zerodp's buckets are always contiguous."""
    with pytest.warns(UserWarning, match="contiguous_gradients=false has no effect"):
        cfg = load_config({"zero_optimization": {"stage": 2, "contiguous_gradients": False}})
    assert cfg.zero_optimization.contiguous_gradients is False


def test_missing_file_and_bad_suffix(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.json")
    (tmp_path / "c.toml").write_text("x=1")
    with pytest.raises(ConfigError, match="use .json, .yaml or .yml"):
        load_config(tmp_path / "c.toml")


def test_batch_size_rules():
    assert ZeroConfig(train_batch_size=24, train_micro_batch_size_per_gpu=4).resolve_batch(3) == (24, 4, 2)
    assert ZeroConfig(train_batch_size=24, gradient_accumulation_steps=2).resolve_batch(3) == (24, 4, 2)
    assert ZeroConfig().resolve_batch(2) == (2, 1, 1)
    with pytest.raises(ConfigError, match="not divisible"):
        ZeroConfig(train_batch_size=10, train_micro_batch_size_per_gpu=4).resolve_batch(2)
    with pytest.raises(ConfigError, match="!="):
        ZeroConfig(train_batch_size=10, train_micro_batch_size_per_gpu=4,
                   gradient_accumulation_steps=1).resolve_batch(2)


VISSL_YAML = """
OPTIMIZER:
  name: zero
  use_zero: true
  base_optimizer:
    name: sgd
    use_larc: true
    larc_config:
      clip: false
      trust_coefficient: 0.001
      eps: 0.00000001
    weight_decay: 0.000001
    momentum: 0.9
    nesterov: false
  param_schedulers:
    lr:
      name: constant
      value: 0.1
MODEL:
  SHARDED_DDP_SETUP:
    USE_SDP: true
    reduce_buffer_size: -1
"""


def test_vissl_dialect(tmp_path):
    path = tmp_path / "vissl.yaml"
    path.write_text(VISSL_YAML)
    with pytest.raises(ConfigError, match=r"VISSL's dialect.*zerodp.adapters.vissl.vissl_engine.initialize"):
        load_config(path)  # the adapter translates VISSL; zerodp's own config refuses it with the fix
    cfg = load_config(translate_vissl(path))
    assert cfg.stage == 2  # USE_SDP
    assert cfg.optimizer.type == "sgd"
    assert cfg.optimizer.params == {"lr": 0.1, "momentum": 0.9, "nesterov": False, "weight_decay": 1e-6,
                                    "larc": {"clip": False, "trust_coefficient": 0.001, "eps": 1e-8}}
    without_sdp = VISSL_YAML.replace("USE_SDP: true", "USE_SDP: false")
    path.write_text(without_sdp)
    assert load_config(translate_vissl(path)).stage == 1  # OPTIMIZER.name: zero alone is optimizer-state sharding


def test_vissl_unknown_key_and_vissl_defaults():
    with pytest.raises(ConfigError, match="did you mean 'use_larc'"):
        translate_vissl({"OPTIMIZER": {"name": "zero", "base_optimizer": {"name": "sgd", "use_lars": True}}})
    # Absent keys take VISSL's defaults (defaults.yaml): the multistep schedule starts at 0.1, momentum 0.9,
    # weight decay 1e-4 (never silent zeros).
    params = load_config(translate_vissl({"OPTIMIZER": {"name": "zero", "base_optimizer": {"name": "sgd"}}})).optimizer.params
    assert params == {"lr": 0.1, "momentum": 0.9, "nesterov": False, "weight_decay": 1e-4}


def test_reference_lists_every_key():
    text = reference_markdown()
    for key in ("zero_optimization.stage", "fp16.initial_scale_power", "zero_optimization.reduce_bucket_size",
                "gradient_clipping", "bf16.enabled"):
        assert f"`{key}`" in text


def test_the_config_used_to_benchmark_deepspeed_loads_unchanged():
    """shared/research/baselines.md ran DeepSpeed with this exact JSON (stage 3 shown)."""
    cfg = load_config({
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-08,
                                                  "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 3}, "steps_per_print": 1000000, "wall_clock_breakdown": False})
    assert cfg.stage == 3 and cfg.steps_per_print == 1000000 and not cfg.wall_clock_breakdown


def test_bucket_sizes_at_stage_3_warn_that_they_do_not_apply():
    with pytest.warns(UserWarning, match="reduce_bucket_size has no effect at stage 3"):
        load_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8}})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}})
        load_config({"zero_optimization": {"stage": 3}})


def test_vissl_reduce_buffer_size_is_the_stage_2_bucket():
    """VISSL passes reduce_buffer_size (elements) to ShardedDDP only under USE_SDP; -1 means fairscale's 2**23."""
    sdp = {"MODEL": {"SHARDED_DDP_SETUP": {"USE_SDP": True, "reduce_buffer_size": 1000}}}
    assert load_config(translate_vissl(sdp)).zero_optimization.reduce_bucket_size == 1000
    sdp["MODEL"]["SHARDED_DDP_SETUP"]["reduce_buffer_size"] = -1
    assert load_config(translate_vissl(sdp)).zero_optimization.reduce_bucket_size == 2 ** 23
    sdp["MODEL"]["SHARDED_DDP_SETUP"]["reduce_buffer_size"] = 0  # fairscale: no bucketing
    assert load_config(translate_vissl(sdp)).zero_optimization.reduce_bucket_size == 1
    no_sdp = {"MODEL": {"SHARDED_DDP_SETUP": {"USE_SDP": False, "reduce_buffer_size": 1000}}}
    with pytest.warns(UserWarning, match="reduce_buffer_size has no effect without USE_SDP"):
        assert load_config(translate_vissl(no_sdp)).stage == 0


@pytest.mark.parametrize("bad", [
    {"MODEL": {"SHARDED_DDP_SETUP": [1, 2]}},                                      # not a mapping
    {"MODEL": {"SHARDED_DDP_SETUP": {"USE_SDP": True, "reduce_buffer_size": "big"}}},  # not a number
    {"OPTIMIZER": {"name": "zero", "base_optimizer": {"name": "sgd", "lr": "fast"}}},
    {"OPTIMIZER": {"name": "zero", "param_schedulers": "cosine", "base_optimizer": {"name": "sgd"}}},
])
def test_vissl_errors_are_one_line_config_errors(bad):
    with pytest.raises(ConfigError) as info:
        translate_vissl(bad)
    message = str(info.value)
    assert message.startswith("VISSL config: ") and "\n" not in message


def test_allgather_bucket_size_at_stage_3_is_honoured_silently():
    """At stage 3 it still bounds engine.full_state_dict()'s gathers, so it is not reported as ignored."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config({"zero_optimization": {"stage": 3, "allgather_bucket_size": 7}}
                           ).zero_optimization.allgather_bucket_size == 7


def test_deepspeed_leniencies_are_read_as_deepspeed_reads_them_with_a_warning():
    """Issue 20: keys DeepSpeed 0.19.8 accepts where the meaning is clear are accepted, each with one warning."""
    cfg = load_config({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_param": {"device": "cpu"}},
                       "bf16": {"enabled": True, "loss_scale": 0}})
    assert cfg.zero_optimization.offload_optimizer.device.value == "cpu"  # the deprecated spelling of cpu offload
    assert cfg.zero_optimization.offload_param.device.value == "none"     # ignored below stage 3, as DeepSpeed does
    assert cfg.bf16.enabled
    assert any("cpu_offload=true is deprecated" in w for w in cfg._warnings)
    assert any("offload_param" in w and "stage 2" in w for w in cfg._warnings)
    assert any(n.startswith("bf16.loss_scale=0 has no effect") for n in cfg._notes)
    # stage 3 keeps offload_param; the deprecated flag beside a contradicting section is one error
    assert load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}) \
        .zero_optimization.offload_param.device.value == "cpu"
    with pytest.raises(ConfigError, match="contradicts zero_optimization.offload_optimizer.device='nvme'"):
        load_config({"zero_optimization": {"stage": 2, "cpu_offload": True,
                                           "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})
    # what DeepSpeed would silently get wrong stays refused: a top-level offload_optimizer
    with pytest.raises(ConfigError, match="offload_optimizer"):
        load_config({"offload_optimizer": {"device": "cpu"}, "zero_optimization": {"stage": 2}})


def test_real_deepspeed_keys_are_never_unknown():
    """Issue 20: every key name DeepSpeed 0.19.8 reads (derived from its source: tools/deepspeed_keys.py) is
    honoured, accepted with no effect, or refused as a missing feature; never "unknown key ... did you mean"."""
    from zerodp.config.strict import deepspeed_key_names

    names = deepspeed_key_names()
    assert len(names) > 400 and {"zenflow", "torch_autocast", "mics_shard_size"} <= names
    for name in sorted(names):
        for where in ("top", "zero"):
            data = {name: {"x": 1}} if where == "top" else {"zero_optimization": {"stage": 2, name: {"x": 1}}}
            try:
                load_config(data)
            except ConfigError as err:
                assert f"unknown key '{name}'" not in str(err), f"{where}-level {name!r}: {err}"
    with pytest.raises(ConfigError, match="'zenflow' is a DeepSpeed setting whose feature zerodp does not implement"):
        load_config({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}})
    with pytest.raises(ConfigError, match="unknown key 'stagee'"):  # a typo is still a typo
        load_config({"zero_optimization": {"stagee": 2}})
