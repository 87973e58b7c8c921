"""DeepSpeed's monitoring sections on 2 ranks: training still equals plain PyTorch, and each monitor writes
what it should. csv_monitor's files (and tensorboard's events, read back with tensorboard's
EventAccumulator) hold exactly the engine's figures; comms_logger's counts and bytes equal comm.record()'s;
flops_profiler's FLOPs equal the closed form for the parity model's Linear layers."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp
from tests.dist.common import HID, IN, OUT, make_model, make_optimizer, micro_batch, reference_mixed_run, \
    reference_run
from zerodp import comm

STEPS, MICRO_BS, GAS, CLIP = 3, 2, 2, 0.5
HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
EVENTS = ("train_loss", "lr", "loss_scale", "grad_norm")


def _config(stage: int, precision: str, out_dir: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BS, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 16,
                                 "stage3_unit_min_params": 1},
           "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "job"},
           "tensorboard": {"enabled": HAVE_TENSORBOARD, "output_path": out_dir, "job_name": "tb"},
           "comms_logger": {"enabled": True},
           "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": f"{out_dir}/flops.txt"}}
    if stage < 3:
        del cfg["zero_optimization"]["stage3_param_persistence_threshold"]
        del cfg["zero_optimization"]["stage3_unit_min_params"]
    if precision == "fp16":  # a scale that cannot overflow here, fixed for these steps (as test_precision)
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}
    return cfg


def monitored_run(stage: int, precision: str, out_dir: str) -> dict:
    """Train with every monitor on; return the engine's own figures next to what the monitors recorded."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    engine = zerodp.initialize(model, make_optimizer("adamw", model), _config(stage, precision, out_dir))
    losses, figures = [], []
    with comm.record() as recorded:
        for step in range(STEPS):
            total, local = torch.zeros(1), None
            for micro in range(GAS):
                x, y = micro_batch(step, micro, rank, world, MICRO_BS, GAS)
                loss = F.mse_loss(engine(x).float(), y)
                engine.backward(loss)
                engine.step()
                total += loss.detach().float()
                local = loss.detach().float() if local is None else local + loss.detach().float()
            dist.all_reduce(total)
            losses.append(total.item() / (world * GAS))
            figures.append({"samples": engine.global_step * engine.train_batch_size,
                            "train_loss": local.item() / GAS, "lr": engine.get_lr()[0],
                            "loss_scale": engine.loss_scale, "grad_norm": engine.grad_norm})
    logged = engine.monitor.comms_logger.summary()
    summary_text = engine.comms_summary()
    report = engine.monitor.flops_profiler.report if rank == 0 else None
    engine.close()
    issued: dict[tuple[str, int], list[int]] = {}
    for r in recorded.records:
        counts = issued.setdefault((r.op, r.nbytes), [0, 0])
        counts[0] += 1
        counts[1] += r.nbytes
    return {"losses": losses, "figures": figures, "issued": issued, "summary_text": summary_text,
            "logged": {(op, nbytes): [s.count, s.nbytes, s.timed] for op, rows in logged.items()
                       for nbytes, s in rows.items()},
            "flops": None if report is None else (report.forward_flops, report.total_flops, report.micro_steps,
                                                  report.step_time_s, report.flops_per_s, report.outside_flops)}


def _read_csv(path: Path) -> tuple[list[str], list[tuple[int, float]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [(int(step), float(value)) for step, value in rows[1:]]


def _expected(figures: list[dict], event: str) -> list[tuple[int, float]]:
    return [(f["samples"], float(f[event])) for f in figures]


@pytest.mark.parametrize("stage,precision", [(2, "fp32"), (3, "fp32"), (1, "fp16")])
def test_monitors_write_the_engines_figures(dist_run, tmp_path, stage, precision):
    world = 2
    results = dist_run(world, monitored_run, stage, precision, str(tmp_path))
    # parity first: monitoring changes nothing in training
    rows = MICRO_BS * world * GAS
    if precision == "fp32":
        ref_losses, _ = reference_run("adamw", STEPS, rows, CLIP)
        rtol = 1e-5
    else:
        ref_losses, _ = reference_mixed_run(torch.float16, "adamw", STEPS, rows, CLIP, loss_scale=256.0)
        rtol = 1e-3  # tests/dist/test_precision.py: two fp16 ulps
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=rtol, atol=0)

    # csv_monitor: rank 0's figures, one file per event, DeepSpeed's names and columns
    figures = results[0]["figures"]
    job = tmp_path / "job"
    written = {"fp32": ["train_loss", "lr", "grad_norm"], "fp16": list(EVENTS)}[precision]
    assert sorted(p.name for p in job.iterdir()) == sorted(f"Train_Samples_{e}.csv" for e in written)
    for event in written:
        header, values = _read_csv(job / f"Train_Samples_{event}.csv")
        assert header == ["step", event]
        assert values == _expected(figures, event), event
    assert [f["samples"] for f in figures] == [rows * (s + 1) for s in range(STEPS)]

    if HAVE_TENSORBOARD:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tmp_path / "tb"))
        acc.Reload()
        assert sorted(acc.Tags()["scalars"]) == sorted(f"Train/Samples/{e}" for e in written)
        for event in written:
            scalars = [(s.step, s.value) for s in acc.Scalars(f"Train/Samples/{event}")]
            # TensorBoard stores scalars as float32
            assert scalars == [(s, float(torch.tensor(v, dtype=torch.float32))) for s, v in _expected(figures, event)]

    # comms_logger: the same collectives comm.record() saw, every one timed, on every rank
    for result in results:
        assert result["issued"], "training issued no collectives"
        assert {k: v[:2] for k, v in result["logged"].items()} == {k: v for k, v in result["issued"].items()}
        assert all(timed == count for count, _, timed in result["logged"].values())
        assert "all_reduce" in result["summary_text"] and "busbw_avg" in result["summary_text"]

    # flops_profiler (rank 0): step 1's two micro-batches of MICRO_BS rows through the parity model's Linears
    forward, total, micro_steps, seconds, per_s, outside = results[0]["flops"]
    b = MICRO_BS * GAS
    fwd = 2 * b * (IN * HID + HID * HID + HID * HID + HID * OUT)    # embed, frozen, hidden, out
    bwd = 2 * b * (IN * HID                                          # embed: weight grad only (x needs none)
                   + HID * HID                                       # frozen: input grad only
                   + 2 * HID * HID + 2 * HID * OUT)                  # hidden, out: both
    assert (forward, total, micro_steps) == (fwd, fwd + bwd, GAS)
    # outside the model: the test's own data (common.global_batch: x @ teacher on the global batch) made after
    # the step's first forward began, i.e. for each micro-step but the first
    assert outside == (GAS - 1) * 2 * rows * IN * OUT
    assert seconds > 0 and per_s == pytest.approx(total / seconds)
    assert results[1]["flops"] is None
    report = (tmp_path / "flops.txt").read_text()
    assert f"total {total / 1e3:.3f} K ({total} FLOPs)" in report and "FLOP/s" in report
