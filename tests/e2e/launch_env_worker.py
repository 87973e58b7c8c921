"""One rank of a job started the way a scheduler starts it: a plain `python` process with srun's or mpirun's
variables and none of torchrun's (tests/e2e/test_launch_env.py spawns several).

    python -m tests.e2e.launch_env_worker OUT_DIR [deepspeed PORT]

Trains the parity model with `zerodp.initialize` (which forms the world from the environment) and saves what
this rank saw to OUT_DIR/rank<r>.pt (with `deepspeed PORT`: the world is made first by DeepSpeed's
`init_distributed(dist_backend="gloo", distributed_port=PORT)` through zerodp.deepspeed): its losses and final parameters, the world, torchrun's variables as exported,
the node layout, the hpZ and MiCS groups' node view and the warnings zerodp logged.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from zerodp import comm
from zerodp.comm import topology
from tests.dist import common
from tests.logged_warnings import zerodp_warnings

STEPS, MICRO_BS = 3, 2
CONFIG = {"train_micro_batch_size_per_gpu": MICRO_BS, "gradient_clipping": 0.5,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 1}}


def main(out: Path, deepspeed_port: int = 0) -> None:
    torch.set_num_threads(1)
    if deepspeed_port:
        import zerodp.deepspeed as deepspeed

        deepspeed.init_distributed(dist_backend="gloo", distributed_port=deepspeed_port)
    with zerodp_warnings() as warnings:
        losses, params = common.zerodp_run(CONFIG, "adamw", STEPS, MICRO_BS)
        result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "losses": losses, "params": params,
                  "exported": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT", "LOCAL_WORLD_SIZE")},
                  "layout": tuple(topology.node_layout()), "world_crosses_nodes": topology.crosses_nodes(None),
                  "warnings": warnings}
    torch.save(result, out / f"rank{dist.get_rank()}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()  # DeepSpeed's init_distributed made it (comm.destroy_distributed: zerodp's own)
    comm.destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[2] == "deepspeed" else 0)
