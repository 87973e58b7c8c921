"""Acceptance: training scripts published by DeepSpeed (examples/) and DeepSpeedExamples (training/),
byte-identical copies in tests/e2e/deepspeed_scripts/ (SOURCES.md), run unchanged under torchrun on 2
gloo ranks through `python -m zerodp.deepspeed.run`, and their per-rank losses equal those real DeepSpeed
0.19.8 produced for the same command (recorded by deepspeed_scripts/record_deepspeed.py).

One script stops on its own, on DeepSpeed too: DeepSpeedExamples' offload_states.py asserts that
`engine.offload_states()` lowers the memory in use, which on a CPU run (where states already live in CPU
memory) it cannot; the test checks that zerodp stops at that same assertion after DeepSpeed's losses.

One case is compared with plain PyTorch instead: the GPT in bf16 with lr 0, whose every loss must be
plain PyTorch's bf16 forward of the initial weights, bitwise (DeepSpeed's own bf16 losses are not: see
`assert_losses_match`).

DeepSpeed-Chat's scripts (steps 1 and 2) import transformers and datasets; where either is missing their
cases are skipped, naming them. Their tiny model is written at test time (tiny_chat.py).

The default suite runs five cases (CIFAR fp32 at stage 3, the ZeRO-3 GPT with its published bf16
config and with lr 0, offload_states in fp32, DeepSpeed-Chat's DPO at stage 2), about 70 s on 2 idle
cores; every case (CIFAR at stages 0-3 and in bf16, the GPT in fp32, torch.compile at stages 2 and 3,
offload_states in bf16, DeepSpeed-Chat's SFT, reward model and DPO at stages 0-2, SFT with LoRA, SFT and
DPO at stage 3):

    ZERODP_ALL_SCRIPT_STAGES=1 python -m pytest tests/e2e/test_deepspeed_scripts.py
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "deepspeed_scripts"))
from cases import CASES, EXPECTED, SEED, TINY_MODEL_KEY, command_args, environment, tiny_model_digest  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src"
ALL = os.environ.get("ZERODP_ALL_SCRIPT_STAGES") == "1"
SELECTED = [c for c in CASES if ALL or c.default]


def _bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)  # bf16 keeps 8 significant bits


def assert_losses_match(case, got: list, want: list) -> None:
    assert len(got) == len(want) > 0, f"{case.name}: {len(got)} losses, DeepSpeed recorded {len(want)}"
    if case.loss_abs_tol is not None:  # bf16 weights, fp32 losses: the reason is at the case (cases.py)
        assert got[0] == want[0], f"{case.name}: first loss {got[0]} != DeepSpeed's {want[0]}"
        assert got == pytest.approx(want, rel=0, abs=case.loss_abs_tol), case.name
        return
    if not case.bf16:
        # fp32: the same operations in the same order as DeepSpeed except the gradient reduction (DeepSpeed
        # reduces bucket by bucket); observed: at most 2.1e-7 relative (CIFAR, 8 steps), 1.1e-7 (the GPT).
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), case.name
        return
    # bf16: the first loss comes before any update, from the same bf16 weights: bitwise equal. Later losses
    # are allowed 2 bf16 ulps (observed: CIFAR bitwise, the GPT 2 ulps): DeepSpeed 0.19.8 on CPU is that far
    # from plain PyTorch's bf16 forward of unchanged weights from the second step on (the GPT with lr 0:
    # 4.21875 where plain PyTorch and zerodp give 4.15625), while zerodp equals plain PyTorch bitwise (case
    # sdma-zero3-bf16-lr0). The cause in DeepSpeed was not traced.
    assert got[0] == want[0], f"{case.name}: first loss {got[0]} != DeepSpeed's {want[0]}"
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= 2 * _bf16_ulp(w), f"{case.name} step {step}: {g} vs DeepSpeed's {w}"


def plain_sdma_losses(world: int = 2, steps: int = 4) -> list:
    """Plain PyTorch, bf16: the sdma script's own model (seed 42, as its main) and synthetic samples, each
    rank's micro-batch of one sample (DistributedSampler without shuffle: rank r's step s is 2 s + r)."""
    import importlib

    import torch

    from zerodp.adapters.deepspeed import alias

    saved = {k: v for k, v in sys.modules.items() if k == "deepspeed" or k.startswith("deepspeed.")}
    alias.install()  # the script's module-level `import deepspeed`
    try:
        script = importlib.import_module("sdma_train_zero3")
    finally:
        for k in [k for k in sys.modules if k == "deepspeed" or k.startswith("deepspeed.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    torch.manual_seed(42)
    model = script.GPT2Model(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=16,
                             dropout=0.0).to(torch.bfloat16)
    data = script.SyntheticTextDataset(64, 16, 16)
    with torch.no_grad():
        return [[model(data[world * s + r][0][None], labels=data[world * s + r][1][None])[0].item()
                 for s in range(steps)] for r in range(world)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", SELECTED, ids=[c.name for c in SELECTED])
def test_deepspeed_script_losses_equal_deepspeed(tmp_path, case):
    missing = [name for name in case.needs if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{case.name} imports {missing}: pip install -e '.[test,hf]'")
    expected = json.loads(EXPECTED.read_text())
    recorded = case.compare_with or case.name  # a different recorded case: the reason is at the case (cases.py)
    if case.reference == "deepspeed" and recorded not in expected:
        pytest.fail(f"{recorded}: DeepSpeed's losses are not recorded; run deepspeed_scripts/record_deepspeed.py "
                    f"{recorded} in the bench venv")
    # the caller's PYTHONPATH stays last (packages installed outside the venv, as in a --target folder)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = environment(case, dict(os.environ, OMP_NUM_THREADS="1", SEED_AT_START=str(SEED),
                                 RECORD_LOSSES=str(tmp_path), RECORD_ENGINE="zerodp"), tmp_path, [str(SRC), *inherited])
    env.pop("DS_ACCELERATOR", None)
    launch = ["-m", "zerodp.deepspeed.run", *(["--local_rank"] if case.local_rank else [])]
    args = command_args(case, tmp_path)
    digest = tiny_model_digest(case, tmp_path)
    if digest is not None:  # DeepSpeed's losses were recorded for these weights only
        assert digest == expected[TINY_MODEL_KEY], ("tiny_chat.py's model has other weights than DeepSpeed was "
                                                    "recorded with (another transformers?): re-record the chat cases")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           "29741", *launch, *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=220)
    if case.expect_error:  # the script's own check stops it where it stops DeepSpeed 0.19.8 (cases.py)
        assert proc.returncode != 0 and case.expect_error in proc.stderr, f"exit {proc.returncode}\n{proc.stderr[-5000:]}"
    else:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for rank in range(2):
        if "STAGE3_PERSISTENCE_THRESHOLD" in dict(case.env):  # DeepSpeed-Chat at stage 3 (cases.py)
            partitioning = json.loads((tmp_path / f"partition_rank{rank}.json").read_text())  # the shim's record
            # its parameters are partitioned, not all kept whole under the persistence threshold
            assert partitioning["stage"] == 3 and partitioning["partitioned"] == partitioning["parameters"] > 0, \
                f"{case.name}: not every parameter is partitioned ({partitioning})"
        got = json.loads((tmp_path / f"losses_rank{rank}.json").read_text())
        if case.reference == "plain":
            assert got == plain_sdma_losses()[rank], f"{case.name} rank {rank}: not bitwise plain PyTorch's"
        else:
            assert_losses_match(case, got, expected[recorded][rank])


def test_deepspeed_loss_reference_names_its_version():
    meta = json.loads(EXPECTED.read_text())["_recorded_with"]
    assert meta["deepspeed"] == "0.19.8" and meta["nproc_per_node"] == 2
    recorded = set(json.loads(EXPECTED.read_text()))
    assert {c.name for c in CASES if c.reference == "deepspeed"} <= recorded
    assert {c.compare_with for c in CASES if c.compare_with} <= {c.name for c in CASES}


def test_copies_are_byte_identical_to_their_sources():
    import hashlib
    import re

    here = EXPECTED.parent
    listed = dict(re.findall(r"^\| `([^`]+)` \| ([0-9a-f]{64}) \|$", (here / "SOURCES.md").read_text(), re.M))
    scripts = {c.script for c in CASES}
    assert scripts <= set(listed), f"copies without a sha256 in SOURCES.md: {sorted(scripts - set(listed))}"
    for name, digest in listed.items():
        assert hashlib.sha256((here / name).read_bytes()).hexdigest() == digest, f"{name} differs from its source"
    # every DeepSpeed-Chat file is a listed copy (nothing of ours hides among them), except the synthetic data
    chat = {str(p.relative_to(here)) for p in (here / "deepspeed_chat").rglob("*.py")}
    assert chat <= set(listed), sorted(chat - set(listed))
