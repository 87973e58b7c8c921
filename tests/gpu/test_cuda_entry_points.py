"""zerodp's entry points on one GPU, run as a user runs them (issue 31, items 3, 5 and 6): `zerodp train`
with its default --nproc (one rank per GPU) exits 0 and reports peak CUDA bytes; a DeepSpeed-style script
with a CPU-built model trains on the GPU like plain PyTorch; ZeroTrainer runs 2 steps like the Trainer;
stage 3 generates with the inference cache (its budget from `torch.cuda.mem_get_info`) the tokens of
the unsharded model.

Skipped where no GPU exists; `make test-gpu` runs them on a lent GPU (docs/gpu.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerodp
from zerodp.tools.models.gpt import GPT, GPTConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    path = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def test_zerodp_train_defaults_to_the_gpus_and_reports_cuda_peak(tmp_path):
    out = tmp_path / "run"
    done = _run(["-m", "zerodp", "train", "--model", "tiny", "--steps", "30", "--precision", "bf16",
                 "--log-every", "10", "--save-every", "0", "--out", str(out)], timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["world_size"] == torch.cuda.device_count()  # the default --nproc: one rank per GPU
    rank0 = summary["ranks"][0]
    assert rank0["peak_cuda_bytes"] > 0 and rank0["peak_cuda_bytes_predicted"] > 0
    assert "CUDA peak" in done.stdout
    assert summary["run"]["final_loss"] < summary["run"]["initial_loss"]
    assert (out / "sample.txt").read_text().strip()  # the sample drew from a CUDA generator
    print(f"zerodp train: CUDA peak measured {rank0['peak_cuda_bytes']:,} B / predicted "
          f"{rank0['peak_cuda_bytes_predicted']:,.0f} B")


def _torchrun(mode: str, out: Path) -> dict:
    _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
          str(ROOT / "tests" / "gpu" / "cuda_scripts.py"), mode, str(out)], timeout=300)
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["deepspeed", "zero_init"])
def test_deepspeed_script_with_a_cpu_built_model(tmp_path, mode):
    """Built on the CPU (deepspeed) or under zero.Init (zero_init), trained at stage 3 on cuda:0."""
    r = _torchrun(mode, tmp_path / f"{mode}.json")
    assert r["backend"] == "cpu:gloo,cuda:nccl"  # NCCL kept: a GPU is visible
    assert r["engine_device"] == "cuda:0" and r["param_devices"] == ["cuda:0"]
    assert r["optimizer_holds_model_params"]  # the optimizer built over the CPU parameters still holds them
    # fp32, one rank, TF32 off: the same kernels as the plain run, up to the order of the clipping norm's sum
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=1e-5, atol=0)
    assert max(r["param_max_rel_diff"].values()) < 1e-4, r["param_max_rel_diff"]


def test_zero_trainer_two_steps(tmp_path):
    pytest.importorskip("transformers")
    r = _torchrun("trainer", tmp_path / "trainer.json")
    assert r["global_step"] == 2 and r["param_devices"] == ["cuda:0"]
    # fp32 on one GPU, TF32 off: the Trainer's arithmetic, up to the order of the clipping norm's sum
    torch.testing.assert_close(torch.tensor(r["zero"]["loss"]), torch.tensor(r["plain"]["loss"]), rtol=1e-4, atol=0)


def test_stage3_generate_with_the_inference_cache(nccl_group):
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = GPTConfig(vocab_size=61, block_size=24, n_layer=4, n_head=2, n_embd=32)
    model, reference = GPT(cfg, seed=3).cuda(), GPT(cfg, seed=3).cuda()
    config = {"zero_optimization": {"stage": 3, "stage3_unit_modules": ["Block"],
                                    "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 0}}
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    engine.eval()
    reference.eval()
    prompt = torch.randint(0, 61, (2, 4), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        greedy = model.generate(prompt, 8, temperature=0)
        sampled = model.generate(prompt, 8, top_k=10, generator=torch.Generator("cuda").manual_seed(1))
        cache = engine.sharding.schedule.inference
        kept, budget = cache.kept_numel, cache.budget_numel
        assert torch.equal(greedy, reference.generate(prompt, 8, temperature=0))
        assert torch.equal(sampled, reference.generate(prompt, 8, top_k=10,
                                                       generator=torch.Generator("cuda").manual_seed(1)))
    free, _ = torch.cuda.mem_get_info()
    assert budget is not None and 0 < budget <= free  # a budget from the device's free memory
    assert kept > 0  # units stayed gathered between the tokens' forwards
    engine.train()
    assert engine.sharding.live_numel == 0  # released when training resumes
    engine.close()
