"""Stages 0, 1 and 2 train exactly like single-process PyTorch on the global batch (fp32)."""

import pytest
import torch

from tests.dist.common import (assert_matches_reference, assert_trained, make_model, reference_run, zerodp_run,
                               zerodp_run_chunked)

STEPS, MICRO_BS, GAS, CLIP = 6, 2, 2, 0.5


def config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BS,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        # small buckets: several buckets per group, launched in order, chunked all-gathers
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 200},
    }


def assert_parity(results, opt_name: str, world: int) -> None:
    ref_losses, ref_params = reference_run(opt_name, STEPS, MICRO_BS * world * GAS, CLIP)
    for rank, (losses, params) in enumerate(results):
        assert_matches_reference(rank, losses, params, ref_losses, ref_params)
    assert_trained(ref_params, make_model().state_dict())


# the last decorator varies slowest: cases of one world size run together and reuse its workers
@pytest.mark.parametrize("opt_name", ["sgd", "adamw", "adamw_fused", "larc", "lamb"])
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_parity_fp32(dist_run, world, stage, opt_name):
    results = dist_run(world, zerodp_run, config(stage), opt_name, STEPS, MICRO_BS)
    assert_parity(results, opt_name, world)


def knobs_run(stage: int) -> bool:
    """The communication settings change how gradients travel, never the result: bit-identical."""
    base = config(stage)
    variants = [{"overlap_comm": False}, {"reduce_scatter": False}]
    if stage == 3:  # shard everything, one unit per Linear; bucket sizes do not apply (units are modules)
        base["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0,
                                     "stage3_unit_min_params": 1}
    else:
        variants += [
            {"reduce_bucket_size": 10**9, "allgather_bucket_size": 10**9},  # one bucket per group
            {"reduce_bucket_size": 1, "allgather_bucket_size": 3},          # one bucket per parameter
        ]
    _, reference = zerodp_run(base, "adamw", 3, MICRO_BS)
    for extra in variants:
        cfg = {**base, "zero_optimization": {**base["zero_optimization"], **extra}}
        _, params = zerodp_run(cfg, "adamw", 3, MICRO_BS)
        if "reduce_bucket_size" in extra:
            # other buckets regroup the gradient norm's sum of squares: the last bit may change
            for k in reference:
                torch.testing.assert_close(params[k], reference[k], rtol=1e-6, atol=1e-7)
        else:
            assert all(torch.equal(params[k], reference[k]) for k in reference), f"{extra} changed the result"
    return True


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [2])
def test_communication_settings_do_not_change_results(dist_run, world, stage):
    assert dist_run(world, knobs_run, stage) == [True] * world


@pytest.mark.parametrize("opt_name", ["sgd", "adamw", "larc", "lamb"])
@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("world", [3])
def test_parity_with_optimizer_chunks_across_parameters(dist_run, world, stage, opt_name):
    """Chunks of 7 elements cut through parameters and shard boundaries: per-parameter norms (LARC,
    LAMB), untouched-parameter restore and clipping must still see whole parameters."""
    results = dist_run(world, zerodp_run_chunked, 7, config(stage), opt_name, STEPS, MICRO_BS)
    assert_parity(results, opt_name, world)
