"""Acceptance (issue 42 part 3): DeepSpeed's own CIFAR example with `--moe` (deepspeed.moe.layer.MoE, its
`split_params_into_different_moe_groups_for_optimizer` groups) runs unchanged under `zerodp.deepspeed` on 2 gloo
ranks, with its 2 experts split over both ranks (ep_size 2), and its per-rank losses equal those of the same
script with both experts on every rank (ep_size 1): expert parallelism changes where experts run, not what is
computed. The experts start as copies of one expert (DeepSpeed's rule), DeepSpeed's random token selection
draws the same numbers either way (the same generator, the same shapes).

Not compared with DeepSpeed: DeepSpeed 0.19.8 with DS_ACCELERATOR=cpu stalls in the first step of this case
(ep_size 1 and 2, no loss recorded in 200 s; docs/moe_ep.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "deepspeed_scripts"))
from cases import SEED, Case, command_args, environment  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src"


def moe_case(ep_size: int) -> Case:
    return Case(f"cifar10-moe-ep{ep_size}", "cifar10_deepspeed.py",
                ("--epochs", "1", "--dtype", "fp32", "--stage", "2", "--moe", "--ep-world-size", str(ep_size),
                 "--num-experts", "2", "--top-k", "1", "--moe-param-group"), path=("shim/cifar",))


def run_losses(tmp: Path, ep_size: int, port: int) -> list:
    case = moe_case(ep_size)
    tmp.mkdir()
    env = environment(case, dict(os.environ, OMP_NUM_THREADS="1", SEED_AT_START=str(SEED), RECORD_LOSSES=str(tmp),
                                 RECORD_ENGINE="zerodp", ZERODP_COMM_TIMEOUT_S="60"), tmp, [str(SRC)])
    env.pop("DS_ACCELERATOR", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(port), "-m", "zerodp.deepspeed.run", *command_args(case, tmp)],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [json.loads((tmp / f"losses_rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_deepspeed_moe_script_runs_with_expert_parallelism(tmp_path):
    split = run_losses(tmp_path / "ep2", 2, 29751)
    whole = run_losses(tmp_path / "ep1", 1, 29753)
    assert all(len(r) > 0 for r in split)
    # fp32, the same operations except where the experts' gradients are summed (ep 2: an all-to-all brings
    # the other rank's tokens; ep 1: an all-reduce of two partial sums): a few float32 roundings per step
    for rank in range(2):
        assert split[rank] == pytest.approx(whole[rank], rel=1e-5, abs=1e-7), f"rank {rank}"
