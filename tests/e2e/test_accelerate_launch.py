"""Acceptance: `accelerate launch --use_deepspeed` runs an unchanged Accelerate script on zerodp with the switch
(docs/frameworks.md's command; tests/e2e/accelerate_job.py, 2 ranks): the variable reaches the launcher (which checks
for DeepSpeed and reads `deepspeed.launcher.runner`) and the ranks torch's elastic launcher starts. At ZeRO stage 2
(the page's command) and stage 3 (its `--zero_stage 3`) the losses, grad norms, lr and final parameters equal the
same script's plain multi-process run (Accelerate's DDP on gloo), launched once for both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.test_docs_frameworks import documented

JOB = Path(__file__).resolve().parent / "accelerate_job.py"
ACCELERATE = str(Path(sys.executable).parent / "accelerate")


def _run(argv: list[str], env: dict, out: Path) -> dict:
    out.mkdir()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=270, env=env, cwd=out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return torch.load(out / "run.pt")


@pytest.mark.timeout(600)
def test_accelerate_launch_use_deepspeed_equals_the_plain_multi_process_run(tmp_path):
    base = {k: v for k, v in os.environ.items() if k != "ZERODP_DEEPSPEED_ALIAS"}
    base["OMP_NUM_THREADS"] = "1"
    # a free port each (accelerate's default 29500 may be taken by another test run)
    argv, doc_env = documented("accelerate", JOB, "--out", str(tmp_path / "zero"),
                               launcher_args=("--main_process_port", "0"))
    assert "--use_deepspeed" in argv and doc_env == {"ZERODP_DEEPSPEED_ALIAS": "1"}
    stage = argv.index("--zero_stage") + 1
    assert argv[stage] == "2"
    zero = _run(argv, {**base, **doc_env}, tmp_path / "zero")
    # the job reads the whole model at the end (accelerator.get_state_dict): at stage 3 Accelerate asks for the 16-bit
    # gather on save, with real DeepSpeed too
    argv3 = [*argv[:stage], "3", "--zero3_save_16bit_model", "true", *argv[stage + 1:]]
    argv3[argv3.index(str(tmp_path / "zero"))] = str(tmp_path / "zero3")
    zero3 = _run(argv3, {**base, **doc_env}, tmp_path / "zero3")
    # the plain run: Accelerate's multi-process launch; without a GPU, ACCELERATE_USE_CPU gives it gloo ranks
    plain_env = {**base, **({} if torch.cuda.is_available() else {"ACCELERATE_USE_CPU": "true"})}
    plain = _run([ACCELERATE, "launch", "--main_process_port", "0", "--multi_gpu", "--num_processes", "2", str(JOB),
                  "--out", str(tmp_path / "plain")], plain_env, tmp_path / "plain")
    for run in (zero, zero3):
        _assert_equal(run, plain)


def _assert_equal(zero: dict, plain: dict) -> None:
    assert zero["distributed_type"] == "DistributedType.DEEPSPEED"
    assert plain["distributed_type"] in ("DistributedType.MULTI_CPU", "DistributedType.MULTI_GPU")
    assert len(zero["losses"]) == len(plain["losses"]) == 6  # 48 samples, 2 ranks of 4
    # fp32 on both sides, the same gradient average over 2 ranks: 1e-5 as the issue asks (observed <= 3e-8)
    torch.testing.assert_close(torch.tensor(zero["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.tensor(zero["grad_norms"]), torch.tensor(plain["grad_norms"]), rtol=1e-5, atol=0)
    assert max(plain["grad_norms"]) > 1.0  # gradient_clipping 1.0 clipped something, on both sides
    assert zero["lrs"] == plain["lrs"]
    assert list(zero["params"]) == list(plain["params"])
    for name, value in plain["params"].items():
        torch.testing.assert_close(zero["params"][name], value, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
