"""World size 1 with real collectives (ZERODP_REAL_COLLECTIVES=1): the path the GPU tests take on one
NCCL rank, run here on one gloo rank. Every stage still trains exactly like plain PyTorch, and the
collectives are really issued to torch.distributed instead of being skipped."""

import os

import pytest
import torch.distributed as dist

from tests.dist.common import assert_matches_reference, reference_run, zerodp_run
from zerodp import comm
from zerodp.comm import collectives

STEPS, MICRO_BS, GAS, CLIP = 4, 2, 2, 0.5


def _config(stage: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 200} if stage < 3 else \
        {"stage": 3, "stage3_param_persistence_threshold": 16, "stage3_unit_min_params": 1}
    return {"train_micro_batch_size_per_gpu": MICRO_BS, "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP, "zero_optimization": zero}


def train_with_real_collectives(stage: int, real: bool):
    """One rank: train with the switch on or off; returns losses, params and the torch collectives issued."""
    issued = []
    saved = {name: getattr(dist, name) for name in ("all_reduce", "broadcast")}
    saved_gather = collectives._all_gather_single

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            issued.append(name)
            return fn(*args, **kwargs)
        return wrapper

    old = os.environ.get(comm.REAL_COLLECTIVES_ENV)
    os.environ[comm.REAL_COLLECTIVES_ENV] = "1" if real else "0"
    try:
        for name, fn in saved.items():
            setattr(dist, name, counting(name, fn))
        collectives._all_gather_single = counting("all_gather", saved_gather)
        assert comm.skips_collectives() is not real
        losses, params = zerodp_run(_config(stage), "adamw", STEPS, MICRO_BS)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        collectives._all_gather_single = saved_gather
        if old is None:
            os.environ.pop(comm.REAL_COLLECTIVES_ENV, None)
        else:
            os.environ[comm.REAL_COLLECTIVES_ENV] = old
    return losses, params, issued


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [1])
def test_world_size_1_with_real_collectives_matches_pytorch(dist_run, world, stage):
    [(losses, params, issued)] = dist_run(world, train_with_real_collectives, stage, True)
    ref_losses, ref_params = reference_run("adamw", STEPS, MICRO_BS * GAS, CLIP)
    assert_matches_reference(0, losses, params, ref_losses, ref_params)
    [(skipped_losses, _, skipped)] = dist_run(world, train_with_real_collectives, stage, False)
    assert skipped_losses == losses  # the switch changes which calls run, never the result
    # with the switch off only the test's own loss average (one all_reduce per step) reaches torch
    assert skipped == ["all_reduce"] * STEPS, skipped
    # on: gradients are reduced (all_reduce on gloo), plus the control flags, at every step, and from
    # stage 1 the updated shards are all-gathered; the initial broadcast of the weights runs too
    assert issued.count("all_reduce") - STEPS >= 2 * STEPS, issued
    assert "broadcast" in issued
    if stage >= 1:
        assert issued.count("all_gather") >= STEPS, issued
