"""`zerodp train` on CUDA, decided as data and checked without a GPU (issue 31, items 3 and 5): the text
sample's generator device, each rank's device, the default --nproc from the GPU count, and the peak CUDA
memory the summary prints (measured / predicted)."""

from __future__ import annotations

import pytest
import torch

from zerodp.tools.app import device, train
from zerodp.tools.app.report import render_summary
from zerodp.tools.app.train_args import resolve_train_args
from zerodp.tools.cli.main import TRAIN_OPTIONS
from zerodp.config import load_config
from zerodp.errors import UsageError
from zerodp.tools.plan.model_shape import run_shape_of, uniform_shape
from zerodp.tools.plan.peak_device import predict_peak_device_bytes
from zerodp.tools.plan.peak_rss import RunShape, predict_peak_rss

CUDA0 = torch.device("cuda", 0)


def test_rank_and_generator_devices_on_cuda():
    assert device.rank_device(True, 1) == torch.device("cuda", 1)
    assert device.rank_device(False, 1) == torch.device("cpu")
    # torch.multinomial refuses a generator on another device than the probabilities (issue 31 item 3)
    assert device.sample_generator_device(CUDA0) == CUDA0
    assert device.sample_generator_device(torch.device("cpu")) == torch.device("cpu")
    assert device.sample_generator(torch.device("cpu"), 5).initial_seed() == 5


class _RecordingGenerator:
    """Stands in for torch.Generator: records the device it was made for."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)

    def manual_seed(self, seed):
        self.seed = seed
        return self


def test_sample_text_puts_the_generator_on_the_prompts_device(monkeypatch):
    """sample_text's wiring, with the meta device standing in for a GPU (a prompt can move there without one):
    the generator handed to generate() is on the prompt's device, seeded with --seed."""
    seen = {}

    class Module:
        def generate(self, prompt, n, temperature, top_k, generator):
            seen.update(prompt=prompt.device, generator=generator.device, seed=generator.seed)
            return torch.zeros(1, 3, dtype=torch.long)

    class Engine:
        module = Module()

        def eval(self):
            pass

        def train(self):
            pass

    monkeypatch.setattr(train, "_device", lambda: torch.device("meta"))
    monkeypatch.setattr(torch, "Generator", _RecordingGenerator)
    args = type("Args", (), {"seed": 11})()
    train.sample_text(Engine(), args)
    assert seen == {"prompt": torch.device("meta"), "generator": torch.device("meta"), "seed": 11}


@pytest.mark.parametrize("gpus, expected", [(0, 2), (1, 1), (4, 4)])
def test_default_nproc_is_the_gpu_count(monkeypatch, tmp_path, gpus, expected):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    opts = dict.fromkeys(TRAIN_OPTIONS)
    args = resolve_train_args({**opts, "model": "tiny", "out": str(tmp_path / "run")})
    assert args.nproc == expected
    if gpus == 1:  # more ranks than GPUs stays refused when asked for
        with pytest.raises(UsageError, match="--nproc 2 is more than the 1 GPU"):
            resolve_train_args({**opts, "model": "tiny", "nproc": 2, "out": str(tmp_path / "run2")})


def test_peak_device_bytes_drop_the_hosts_terms():
    model = uniform_shape(10_000_000, 10, 4 * 2**20)
    run = RunShape(world_size=2, stage=3, has_gpu=True)
    rss = predict_peak_rss(model, run, baseline_bytes=300 * 2**20)
    dev = predict_peak_device_bytes(model, run)
    names = {t.name for t in dev.terms}
    assert not names & {"baseline", "heap retention"}
    # everything else is the RSS model's: the same states and working set
    assert dev.total == pytest.approx(rss.total - rss.term("baseline") - rss.term("heap retention"))
    # ZeRO-Offload keeps masters and optimizer states on the host: off the device, exactly
    offloaded = predict_peak_device_bytes(model, RunShape(world_size=2, stage=3, optimizer_offload="cpu"))
    assert offloaded.term("optimizer states") == 0
    assert dev.total - offloaded.total == pytest.approx(rss.term("optimizer states"))
    # offload_param: only the persistent parameters stay on the device
    assert predict_peak_device_bytes(model, RunShape(world_size=2, stage=3, param_offload="cpu")).term(
        "parameters") == 0


def test_train_predicts_peak_cuda_bytes_from_the_config():
    cfg = load_config({"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 2})
    one = device.predicted_peak_cuda_bytes("tiny", cfg, 1, 32)
    two = device.predicted_peak_cuda_bytes("tiny", cfg, 2, 32)
    assert one > two > 0  # optimizer states shard over the ranks
    run = run_shape_of(cfg, 2, "adamw", has_gpu=True)
    assert run.stage == 1 and run.param_bytes == 4
    sgd = load_config({"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 2,
                       "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}})
    assert device.predicted_peak_cuda_bytes("tiny", sgd, 1, 32) < one  # one state per element, not two


def _rank(**extra) -> dict:
    r = {"rank": 0, "peak_rss_bytes": 2**30, "padding_numel": 0}
    for kind in ("params", "grads", "optimizer"):
        r[f"{kind}_bytes"] = r[f"{kind}_bytes_predicted"] = 2**20
    return {**r, **extra}


def test_summary_prints_cuda_peak_measured_and_predicted_beside_rss():
    run = {"stage": 1, "world_size": 1, "model": "tiny", "numel": 1, "precision": "fp32", "first_step": 1,
           "last_step": 2, "tokens_per_s": 1.0, "step_time_s": 1.0, "initial_loss": 1.0, "final_loss": 1.0,
           "final_loss_window": 1, "val_loss": None, "checkpoint": None, "checkpoint_note": "n", "plot": None,
           "plot_note": "n", "out": "o", "wall_time_s": 1.0}
    text = render_summary(run, [_rank(peak_cuda_bytes=3 * 2**29, peak_cuda_bytes_predicted=2**30)])
    assert "| 1.00 GiB; CUDA peak 1.50 GiB / 1.00 GiB |" in text
    assert "CUDA" not in render_summary(run, [_rank()])  # a CPU run prints RSS alone
