"""DeepSpeed's MoE config key: the default layout is zerodp's, the other is refused (docs/moe_ep.md)."""

import pytest

import zerodp


def test_use_data_before_expert_parallelism():
    zerodp.load_config({"train_micro_batch_size_per_gpu": 1, "use_data_before_expert_parallelism": False})
    with pytest.raises(zerodp.ConfigError, match="D \\+ E rank layout"):
        zerodp.load_config({"train_micro_batch_size_per_gpu": 1, "use_data_before_expert_parallelism": True})
