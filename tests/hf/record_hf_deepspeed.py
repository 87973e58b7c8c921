"""Record the HF Trainer + real DeepSpeed's per-step lr and losses on HF templates into expected_hf_deepspeed.json.

    cd <repo> && /work/main/bench/.venv/bin/python tests/hf/record_hf_deepspeed.py [CONFIG.json ...]

(with config names: records only those, keeping the others already recorded)

The bench venv holds DeepSpeed 0.19.8 and the lock's transformers / accelerate; it is a reference environment,
not a zerodp dependency. Each config runs under torchrun on 2 gloo ranks with DS_ACCELERATOR=cpu: the tiny GPT-2,
data and TrainingArguments of tests/hf/tiny_setup.py with `deepspeed=<config>` (the same arguments as
template_worker.py), and LrProbe sees the lr of every step of DeepSpeed's inner optimizer. One config per ZeRO stage,
covering the four ways a template sets the optimizer and schedule (see CONFIGS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "tests" / "configs" / "deepspeed"
EXPECTED = ROOT / "tests" / "hf" / "expected_hf_deepspeed.json"
CONFIGS = {
    "flagembedding__ds_stage0.json": "stage 0; optimizer and WarmupDecayLR sections",
    "internvl__zero_stage1_config.json": "stage 1; optimizer section, the Trainer's linear schedule",
    "qwen__ds_config_zero2.json": "stage 2; optimizer and WarmupLR sections",
    "swift__zero3.json": "stage 3; the Trainer's optimizer and schedule",
}
STEPS, WARMUP = 6, 3  # as template_worker.py


def _keep_gloo_only() -> None:
    """DeepSpeed's init_distributed may hand torch "cpu:gloo,cuda:nccl", which this CPU-only torch refuses; keep the
    gloo entry (test instrumentation of the reference run only)."""
    import torch
    import torch.distributed as dist

    original = dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        # NCCL built is not a GPU present (zerodp/comm/backend.py): a CUDA torch without a GPU refuses it too
        if isinstance(backend, str) and ":" in backend and not (dist.is_nccl_available() and torch.cuda.is_available()):
            backend = ",".join(e for e in backend.split(",") if not e.strip().endswith(":nccl"))
        return original(backend, *args, **kwargs)

    dist.init_process_group = init_process_group


def worker(name: str, result: str) -> None:
    """One rank: the HF Trainer with DeepSpeed on CONFIG_DIR/name."""
    _keep_gloo_only()
    import torch.distributed as dist
    from transformers import Trainer

    from tests.hf.tiny_setup import LrProbe, Sequences, arguments, history, make_model

    with tempfile.TemporaryDirectory() as out:
        args = arguments(out, max_steps=STEPS, warmup_steps=WARMUP, eval_strategy="no", save_strategy="no",
                         deepspeed=str(CONFIG_DIR / name))
        probe = LrProbe()
        trainer = Trainer(model=make_model(), args=args, train_dataset=Sequences(), callbacks=[probe])
        trainer.train()
        probe.close()
        stage = trainer.model_wrapped.zero_optimization_stage()
        if dist.get_rank() == 0:
            logged = history(trainer)
            Path(result).write_text(json.dumps({
                "stage": stage, "steps": logged["steps"], "loss": logged["loss"], "grad_norm": logged["grad_norm"],
                "lr_used": probe.used,
                # HF + DeepSpeed logs the scheduler's last lr after DeepSpeed's engine has stepped it: the next
                # step's lr (ZeroTrainer logs the lr the step used); kept to show the difference
                "lr_logged": logged["lr"]}))


def main(names: list[str]) -> None:
    import deepspeed
    import torch
    import transformers

    meta = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "DS_ACCELERATOR": "cpu", "nproc_per_node": 2}
    results = json.loads(EXPECTED.read_text()) if names and EXPECTED.exists() else {}
    if names and results.get("_recorded_with", meta) != meta:
        raise SystemExit(f"{EXPECTED.name} was recorded with {results.get('_recorded_with')}, not {meta}: record all")
    unknown = set(names) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"not a recorded config: {sorted(unknown)} (add it to CONFIGS with its reason)")
    results["_recorded_with"] = meta
    results["_configs"] = CONFIGS
    for name in names or list(CONFIGS):
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
                       HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   __file__, "--worker", name, str(result)]
            proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{name}: HF Trainer + DeepSpeed failed\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
            results[name] = json.loads(result.read_text())
            print(name, results[name], flush=True)
    EXPECTED.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1:])
