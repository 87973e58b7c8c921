"""ZeroTrainer acceptance: a small GPT-2 (from a config, no download) under torchrun on 2 ranks trained by
the plain Trainer (DDP) and by ZeroTrainer at stages 2 and 3 with the same arguments and seed; then a
resume from checkpoint-3 on 3 ranks, and the saved model reloaded with from_pretrained."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "hf" / "hf_worker.py"


def torchrun(nproc: int, mode: str, out: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]), HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(WORKER), mode, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"torchrun {mode} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    torchrun(2, "train", out)
    return out, json.loads((out / "results.json").read_text())


def test_zero_trainer_matches_ddp_trainer(runs):
    out, results = runs
    ddp = results["ddp"]
    assert ddp["steps"] == [1, 2, 3, 4, 5, 6] and ddp["loss"][-1] < ddp["loss"][0]  # it trained
    for stage in (2, 3):
        zero = results[f"stage{stage}"]
        assert zero["steps"] == ddp["steps"]
        assert zero["loss"] == pytest.approx(ddp["loss"], rel=1e-5)
        assert zero["eval_loss"] == pytest.approx(ddp["eval_loss"], rel=1e-5)
        assert zero["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=1e-5)
        assert zero["lr"] == pytest.approx(ddp["lr"], rel=1e-12)  # the Trainer's warmup + linear schedule
        # save_steps: checkpoint-3 and checkpoint-6 with the consolidated model and zerodp's shards
        for step in (3, 6):
            folder = out / f"stage{stage}" / f"checkpoint-{step}"
            assert (folder / "model.safetensors").exists() and (folder / "zerodp" / "meta.json").exists()
        # save_model: from_pretrained gives the live model's logits
        assert results[f"stage{stage}_logits_maxdiff"] <= 1e-6
    # "auto" bucket sizes from the hidden size 32, as the HF Trainer fills them for DeepSpeed
    assert results["stage2_zero"]["reduce_bucket_size"] == 32 * 32
    assert results["stage3_zero"]["stage3_prefetch_bucket_size"] == int(0.9 * 32 * 32)
    assert results["stage3_zero"]["stage3_param_persistence_threshold"] == 320


def test_hf_deepspeed_template_trains_with_its_own_scheduler(runs):
    """transformers' ds_config_zero2.json unchanged (every value "auto", a WarmupLR section): the config's
    schedule is the only one (as under HF + DeepSpeed), its lr values are filled from the arguments, and the run
    equals the plain Trainer driven by DeepSpeed's WarmupLR; it trains (the lr=0 run of issue 20 did not)."""
    _, results = runs
    ref, zero = results["template_ref"], results["template"]
    assert zero["steps"] == ref["steps"] == [1, 2, 3, 4, 5, 6]
    assert zero["lr"] == pytest.approx(ref["lr"], rel=1e-12) and max(zero["lr"]) == pytest.approx(3e-3)
    assert zero["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert results["template_moved"] > 1e-3, "no parameter changed: the run trained nothing"
    refusal = results["two_schedulers"]
    assert refusal is not None and "two LR schedulers" in refusal and "WarmupLR" in refusal and "LambdaLR" in refusal


def test_resume_from_checkpoint_on_three_ranks(runs):
    out, results = runs
    torchrun(3, "resume", out)
    resumed = json.loads((out / "resume.json").read_text())
    assert resumed["world"] == 3 and resumed["global_step"] == 6
    assert resumed["resume_param_maxdiff"] == 0.0 and resumed["checkpoint_moved"] > 1e-3
    two_ranks = results["stage3"]
    assert resumed["steps"] == [1, 2, 3, 4, 5, 6]  # the history of steps 1-3 came with the checkpoint
    assert resumed["loss"][:3] == two_ranks["loss"][:3]
    assert resumed["lr"] == pytest.approx(two_ranks["lr"], rel=1e-12)  # the scheduler resumed at step 3
    # steps 4-6 see 3 ranks' batches, so they differ from the 2-rank run but keep training from its state
    assert all(abs(a - b) < 0.05 for a, b in zip(resumed["loss"][3:], two_ranks["loss"][3:]))


def test_resume_of_an_offloaded_bf16_stage3_run_equals_the_uninterrupted_run(runs):
    """Issue 23: ZeroTrainer saves and loads through the engine, checked on the hardest case: bf16 (the
    arguments' bf16 fills the config's "auto"), stage 3, both offloads on nvme, parameter shards cached for
    no longer than they are used (max_in_cpu 0, hf_worker.offload_config). `train` ran 6 steps with save_steps 3; a fresh torchrun on the same 2 ranks resumes
    from checkpoint-3. The resumed steps 4-6 are the uninterrupted run's bitwise (losses, grad norms, lrs): same
    ranks, same batches (the Trainer skips the ones already seen), same arithmetic; and the fp32 masters at the
    first resumed step are checkpoint-3's consolidated model exactly."""
    out, results = runs
    whole = results["offload"]
    assert whole["steps"] == [1, 2, 3, 4, 5, 6] and whole["loss"][-1] < whole["loss"][0]  # it trained
    for rank in results["offload_ranks"]:
        assert rank["param_dtype"] == "torch.bfloat16", rank
        # both offloads on disk: Adam's 2 fp32 moments of every owned element (8 B each), and more: the bf16
        # parameter shards (all but the few elements of parameters under the persistence threshold, kept whole)
        assert rank["disk_bytes"] > 8 * rank["owned_numel"] > 0, rank
    torchrun(2, "resume_offload", out)
    resumed = json.loads((out / "resume_offload.json").read_text())
    assert resumed["global_step"] == 6 and resumed["steps"] == whole["steps"]
    for key in ("loss", "grad_norm", "lr"):  # steps 1-3 came with the checkpoint's history; 4-6 were trained
        assert resumed[key] == whole[key], key
    assert resumed["compared"] > 0 and resumed["resume_param_maxdiff"] == 0.0
