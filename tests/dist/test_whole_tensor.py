"""Optimizers that read whole tensors (Muon + AdamW, Adafactor) train exactly like single-process
PyTorch at stages 1-3: each rank owns whole tensors of their groups (flat/whole_tensor_layout.py)."""

from __future__ import annotations

import pytest
import torch

import zerodp
from tests.dist.whole_tensor_common import config, make_gpt, make_optimizers, reference_run, register, train

STEPS = 4


def zerodp_run(stage: int, name: str) -> tuple[list[float], dict]:
    import torch.distributed as dist

    register()
    model = make_gpt()
    engine = zerodp.initialize(model, make_optimizers(name, model), config(stage, dist.get_world_size()))
    losses = train(engine, 0, STEPS)
    return losses, engine.full_state_dict(rank0_only=False)


@pytest.mark.parametrize("name", ["muon", "adafactor"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [2, 3])
def test_whole_tensor_parity_fp32(dist_run, world, stage, name):
    register()
    ref_losses, ref_params = reference_run(name, STEPS)
    for rank, (losses, params) in enumerate(dist_run(world, zerodp_run, stage, name)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                                   msg=lambda m: f"rank {rank} losses differ: {m}")
        for key, ref in ref_params.items():
            torch.testing.assert_close(params[key], ref, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {key} differs: {m}")
    init = make_gpt().state_dict()
    assert max((ref_params[k] - init[k]).abs().max().item() for k in init) > 1e-2  # it trained
