"""ZeroTrainer's "auto" filling from TrainingArguments, and contradictions named with both values."""

from types import SimpleNamespace

import pytest

from zerodp.config import ConfigError, load_config
from zerodp.integrations.hf_auto import fill_auto

ARGS = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.5, fp16=False,
                       bf16=True, learning_rate=2e-4, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-6,
                       weight_decay=0.1)
MODEL = SimpleNamespace(config=SimpleNamespace(hidden_size=64))


def test_auto_values_follow_the_arguments():
    config = fill_auto({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                                  "weight_decay": "auto"}},
                        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
                                              "stage3_param_persistence_threshold": "auto"}}, ARGS, 3, MODEL)
    assert config["train_batch_size"] == 24 and config["train_micro_batch_size_per_gpu"] == 4
    assert config["gradient_accumulation_steps"] == 2 and config["gradient_clipping"] == 0.5
    assert config["bf16"] == {"enabled": True}
    assert config["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert config["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert config["zero_optimization"]["stage3_param_persistence_threshold"] == 640
    assert load_config(config).resolve_batch(3) == (24, 4, 2)
    # absent keys are set from the arguments too, so the engine and the Trainer never disagree
    assert fill_auto({}, ARGS, 2, MODEL)["gradient_clipping"] == 0.5


def test_contradictions_name_both_values():
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu=8 but TrainingArguments"
                                          r"\.per_device_train_batch_size=4"):
        fill_auto({"train_micro_batch_size_per_gpu": 8}, ARGS, 2, MODEL)
    with pytest.raises(ConfigError, match=r"gradient_clipping=1\.0 but TrainingArguments\.max_grad_norm=0\.5"):
        fill_auto({"gradient_clipping": 1.0}, ARGS, 2, MODEL)
    with pytest.raises(ConfigError, match=r"fp16\.enabled=True but TrainingArguments\.fp16=False"):
        fill_auto({"fp16": {"enabled": True}}, ARGS, 2, MODEL)
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr=0\.1 but TrainingArguments\.learning_rate"):
        fill_auto({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, ARGS, 2, MODEL)
    with pytest.raises(ConfigError, match="no hidden_size"):
        fill_auto({"zero_optimization": {"reduce_bucket_size": "auto"}}, ARGS, 2, SimpleNamespace(config=None))
    with pytest.raises(ConfigError, match="zero_optimization.offload_param.device"):
        fill_auto({"zero_optimization": {"offload_param": {"device": "auto"}}}, ARGS, 2, MODEL)
