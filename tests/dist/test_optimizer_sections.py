"""A list of optimizer sections in the config (Muon on the matrices, AdamW on the rest, chosen by
`select`) trains exactly like plain single-process PyTorch with the same two optimizers."""

from __future__ import annotations

import pytest

import zerodp
from tests.dist.common import assert_matches_reference, assert_trained
from tests.dist.whole_tensor_common import (
    config,
    make_gpt,
    reference_run,
    register,
    train,
)

STEPS = 3
SECTIONS = [
    {"type": "MuonFP32", "select": "matrices",  # registered by name (whole_tensor_common.register)
     "params": {"lr": 0.05, "weight_decay": 0.01, "momentum": 0.9, "ns_coefficients": [1.5, -0.5, 0.0]}},
    {"type": "AdamW", "select": "rest", "params": {"lr": 1e-2, "weight_decay": 0.01}},
]


def sections_run(stage: int, units: list) -> tuple[list[float], dict, list[str]]:
    import torch.distributed as dist

    register()
    cfg = config(stage, dist.get_world_size(), stage3_unit_modules=units)
    cfg["optimizer"] = SECTIONS
    engine = zerodp.initialize(make_gpt(), config=cfg)
    losses = train(engine, 0, STEPS)
    return losses, engine.full_state_dict(rank0_only=False), [type(o).__name__ for o in engine.user_optimizer.optimizers]


@pytest.mark.parametrize("stage, units", [(1, []), (3, ["Block"])])
def test_config_optimizer_list_parity(dist_run, stage, units):
    ref_losses, ref_params = reference_run("muon_fp32", STEPS)  # MuonFP32(blocks' matrices) + AdamW(rest)
    for rank, (losses, params, kinds) in enumerate(dist_run(2, sections_run, stage, units)):
        assert kinds == ["MuonFP32", "AdamW"]
        assert_matches_reference(rank, losses, params, ref_losses, ref_params)
    assert_trained(ref_params, make_gpt().state_dict())
