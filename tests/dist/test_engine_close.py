"""`engine.close()` gives back everything the engine created (issue 19): the stage-3 parameter
registry's entries, the reduction communicator and its gloo threads, the offload I/O threads and
files, the watchdog thread. Measured deterministically against the baseline taken before
`zerodp.initialize`: OS threads (gloo's C++ threads included), open file descriptors, registry size.

Why it matters: whatever outlives the engine is torn down by C++ static destructors at interpreter
shutdown, while gloo's threads still run, and the process aborts ("terminate called without an
active exception"; [Note: teardown] in comm/process_group.py).
"""

from __future__ import annotations

import gc
import threading

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp
from zerodp import comm
from tests.dist.common import make_model, micro_batch
from zerodp.shard.stage3 import params as stage3_params


def _resources() -> dict:
    gc.collect()
    proc = psutil.Process()
    return {"os_threads": proc.num_threads(), "python_threads": sorted(t.name for t in threading.enumerate()),
            "fds": proc.num_fds(), "registry": len(stage3_params._OWNERS)}


def close_returns_to_baseline(stage: int, nvme_dir: str, close_twice: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    zero = {"stage": stage}
    if stage == 3:  # the offload tiers start I/O threads and open files
        zero |= {"offload_param": {"device": "nvme", "nvme_path": nvme_dir},
                 "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir},
                 "stage3_param_persistence_threshold": 0}
    model = make_model()
    # the pool's ranks ran other cases before this one: a watchdog thread an earlier engine started (and did not
    # close) would be stopped by this close() and make the count lower than the baseline
    comm.watchdog.stop()
    before = _resources()
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), {"zero_optimization": zero})
    for step in range(2):
        x, y = micro_batch(step, 0, rank, world, 3, 1)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    during = _resources()
    engine.close()
    if close_twice:
        engine.close()  # idempotent
    after = _resources()
    assert dist.is_initialized(), "close() destroyed the default group, which the caller created"
    # A communicator made after another was destroyed must not inherit the dead one's name and store keys
    # (gloo then connects to dead ports: [Note: local communicators]): a second engine on the same ranks trains.
    again = zerodp.initialize(make_model(), None, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                                   "zero_optimization": {"stage": 3}})
    x, y = micro_batch(0, 0, rank, world, 3, 1)
    again.backward(F.mse_loss(again(x), y))
    again.step()
    again.close()
    return {"before": before, "during": during, "after": after}


@pytest.mark.parametrize("stage", [2, 3])
def test_close_returns_threads_fds_and_registry_to_baseline(dist_run, stage, tmp_path):
    for rank_result in dist_run(2, close_returns_to_baseline, stage, str(tmp_path), close_twice=stage == 3):
        before, during, after = rank_result["before"], rank_result["during"], rank_result["after"]
        if stage == 3:  # the test would be vacuous if the engine had created nothing to release
            assert during["os_threads"] > before["os_threads"], rank_result
            assert during["registry"] > before["registry"], rank_result
        assert after == before, f"close() left resources behind: {rank_result}"
