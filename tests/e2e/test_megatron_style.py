"""Acceptance: a Megatron-DeepSpeed-style script (tests/e2e/megatron_style: Megatron's mpu module,
`deepspeed.checkpointing.configure(mpu, deepspeed_config=...)`, `model_parallel_cuda_manual_seed`, the
checkpointing module's RNG tracker and `checkpoint`, `deepspeed.initialize(..., mpu=mpu)`) runs unchanged
under torchrun through `python -m zerodp.deepspeed.run` as TP 2 x DP 2 on 4 gloo ranks, with ZeRO stage 2 and
activation checkpoints partitioned over the tensor-parallel group and kept in host memory; every rank's
losses and gradient norms equal the single-process unsharded reference of tests/dist/tensor_parallel_common.py
(the same model, data, seeds and config)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist.tensor_parallel_common import STEPS_DEFAULT, TP, DP, config, reference_run

SCRIPT = Path(__file__).resolve().parent / "megatron_style" / "pretrain_tp_gpt.py"


@pytest.mark.timeout(300)
def test_megatron_deepspeed_style_script(tmp_path):
    cfg = {**config(2), "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(TP * DP),
                           "--standalone", "-m", "zerodp.deepspeed.run", str(SCRIPT),
                           "--deepspeed_config", str(tmp_path / "ds.json"), "--tensor-model-parallel-size", str(TP),
                           "--checkpoint-activations", "--train-iters", str(STEPS_DEFAULT),
                           "--out", str(tmp_path / "result")],
                          capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    ref_losses, ref_norms, _ = reference_run("adamw", STEPS_DEFAULT)
    for rank in range(TP * DP):
        got = json.loads((tmp_path / f"result.rank{rank}").read_text())
        assert (got["tp"], got["dp"]) == (rank % TP, rank // TP)
        # fp32, the same sums in another order: rtol 1e-5 (tests/dist/test_tensor_parallel.py)
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses[got["dp"]]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    # the configured checkpointing was in effect: the script logged it on configure
    assert "partition_activations=True cpu_checkpointing=True" in proc.stdout + proc.stderr
