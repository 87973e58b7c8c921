"""What `zerodp train` writes and prints: the metrics files, the end-of-run summary, the loss plot.

Rank 0 owns all of it. `MetricsLog` appends one row per optimizer step to `metrics.jsonl` and
`metrics.csv` (a resumed run appends to the same files, so the plot shows the whole curve);
`render_summary` turns the per-rank memory reports and the run's figures into the table printed at
the end; `plot_loss` draws the loss curve with matplotlib's Agg backend, or explains why it did not.
No torch.distributed here: the caller gathers what it needs first.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Optional

from ..plan import format_bytes

METRIC_FIELDS = ("step", "loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "step_time_s", "rss_bytes")


class MetricsLog:
    """Per-step metrics appended to `out/metrics.jsonl` and `out/metrics.csv` (flushed every row)."""

    def __init__(self, out_dir: Path) -> None:
        self.jsonl_path = out_dir / "metrics.jsonl"
        self.csv_path = out_dir / "metrics.csv"
        new_csv = not self.csv_path.exists() or self.csv_path.stat().st_size == 0
        self._jsonl = self.jsonl_path.open("a")
        self._csv_file = self.csv_path.open("a", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=METRIC_FIELDS)
        if new_csv:
            self._csv.writeheader()

    def write(self, row: dict) -> None:
        row = {k: row.get(k) for k in METRIC_FIELDS}
        self._jsonl.write(json.dumps(row) + "\n")
        self._csv.writerow({k: "" if v is None else v for k, v in row.items()})
        self._jsonl.flush()
        self._csv_file.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()


def read_metrics(out_dir: Path) -> list[dict]:
    """Rows of `metrics.jsonl`, one per step; a step logged twice (a resumed run) keeps its last row."""
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short when a rank was killed mid-write (a restarted run logs the step again)
        if isinstance(row, dict) and "step" in row:
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def format_log_line(row: dict, total_steps: int) -> str:
    """The line printed every `--log-every` steps."""
    grad_norm = "-" if row["grad_norm"] is None else f"{row['grad_norm']:.3f}"
    return (f"step {row['step']:>5}/{total_steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
            f"grad_norm {grad_norm} | loss_scale {row['loss_scale']:g} | {row['tokens_per_s']:,.0f} tok/s | "
            f"{row['step_time_s']:.3f} s/step | rss {format_bytes(row['rss_bytes'])}")


def _pair(measured: float, predicted: float) -> str:
    return f"{format_bytes(measured)} / {format_bytes(predicted)}"


def _cuda_peak(rank: dict) -> str:
    """A CUDA rank's peak device memory beside its peak RSS: measured / predicted (plan/peak_device.py)."""
    measured = rank.get("peak_cuda_bytes")
    if measured is None:
        return ""
    predicted = rank.get("peak_cuda_bytes_predicted")
    return (f"; CUDA peak {format_bytes(measured)} / "
            + ("-" if predicted is None else format_bytes(predicted)))


def render_summary(run: dict, ranks: list[dict]) -> str:
    """The end-of-run table: per-rank model-state bytes (measured / predicted), peak RSS, then the run.

    `ranks` holds one `MemoryReport.as_dict()` per rank plus `peak_rss_bytes` (and on CUDA `peak_cuda_bytes`,
    `peak_cuda_bytes_predicted`: printed in the peak column as "RSS; CUDA peak measured / predicted"); `run` holds the
    figures named below (None where a figure does not exist, e.g. no checkpoint).
    """
    tp = run.get("tensor_parallel", 1)  # --tp: each rank holds 1/tp of the sharded matrices (numel is per rank)
    layout = f" = tensor-parallel {tp} x data-parallel {run['world_size'] // tp}" if tp > 1 else ""
    lines = [f"zerodp train summary: stage {run['stage']}, {run['world_size']} rank(s){layout}, model {run['model']} "
             f"({run['numel']:,} parameters{' per rank' if tp > 1 else ''}), {run['precision']}, "
             f"steps {run['first_step']}..{run['last_step']}",
             "",
             "model states per rank, measured / predicted by the ZeRO formula (memory.predict_model_state_bytes):",
             "| rank | parameters | gradients | optimizer states | total | peak RSS |",
             "|---|---|---|---|---|---|"]
    for r in ranks:
        measured = r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"]
        predicted = r["params_bytes_predicted"] + r["grads_bytes_predicted"] + r["optimizer_bytes_predicted"]
        lines.append(f"| {r['rank']} | {_pair(r['params_bytes'], r['params_bytes_predicted'])} | "
                     f"{_pair(r['grads_bytes'], r['grads_bytes_predicted'])} | "
                     f"{_pair(r['optimizer_bytes'], r['optimizer_bytes_predicted'])} | "
                     f"{_pair(measured, predicted)} | {format_bytes(r['peak_rss_bytes'])}{_cuda_peak(r)} |")
    padding = ranks[0].get("padding_numel", 0) if ranks else 0
    lines.append(f"(measured exceeds predicted by the {padding} padding element(s) that make shards even; the "
                 f"gradient column is what is allocated at the end of a step)")
    persistent = ranks[0].get("persistent_param_bytes", 0) if ranks else 0
    if persistent:
        lines.append(f"(stage 3 keeps {format_bytes(persistent)} of parameters whole on every rank: the units "
                     f"below stage3_param_persistence_threshold, as DeepSpeed does; the formula shards them too)")
    lines.append("")

    def row(name: str, value) -> None:
        lines.append(f"{name:<16}{value}")

    r = ranks[0] if ranks else {}
    if r.get("activation_checkpointing"):
        row("activations", f"checkpoints kept per rank, measured / predicted: device "
            f"{_pair(r['activation_kept_device'], r['activation_kept_device_predicted'])}, host "
            f"{_pair(r['activation_kept_host'], r['activation_kept_host_predicted'])}; activation peak predicted "
            f"{format_bytes(r['activation_device_predicted'])} per rank "
            f"({format_bytes(r['activation_device_predicted_off'])} without checkpointing)")
    elif "activation_device_predicted_off" in r:
        row("activations", f"not checkpointed: {format_bytes(r['activation_device_predicted_off'])} per rank "
            f"predicted (--checkpoint-activations keeps only each block's input; zerodp estimate --model)")
    row("tokens/s", f"{run['tokens_per_s']:,.0f} (all ranks, mean over the timed steps)")
    row("step time", f"{run['step_time_s']:.3f} s (mean)")
    row("loss", f"{run['initial_loss']:.4f} -> {run['final_loss']:.4f} (train; final is the mean of the "
        f"last {run['final_loss_window']} steps)")
    row("val loss", "-" if run["val_loss"] is None else f"{run['val_loss']:.4f}")
    row("checkpoint", run["checkpoint"] or f"not written ({run['checkpoint_note']})")
    row("loss plot", run["plot"] or f"not drawn ({run['plot_note']})")
    row("metrics", f"{run['out']}/metrics.jsonl, {run['out']}/metrics.csv")
    row("wall time", f"{run['wall_time_s']:.1f} s")
    return "\n".join(lines)


def plot_loss(out_dir: Path, rows: list[dict], val_loss: Optional[float], title: str) -> tuple[Optional[Path], str]:
    """Draw `out/loss.png` (train loss per step, val loss at the end). Returns (path or None, note)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed; must precede pyplot's import
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "matplotlib is not installed; pip install 'zerodp[plot]'"
    if not rows:
        return None, "no metrics were logged"
    steps = [r["step"] for r in rows]
    losses = [r["loss"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, losses, lw=0.8, alpha=0.5, label="train loss (per step)")
    window = max(1, len(losses) // 50)
    if window > 1:
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(steps, smooth, lw=1.5, label=f"train loss ({window}-step mean)")
    if val_loss is not None and math.isfinite(val_loss):
        ax.scatter([steps[-1]], [val_loss], color="C3", zorder=3, label=f"val loss {val_loss:.3f}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / "loss.png"
    fig.savefig(path)
    plt.close(fig)
    return path, ""


def activation_report(args, micro_batch: int) -> dict:
    """This rank's activation figures: checkpoints kept (measured peak, device and host) and the formula's
    prediction with the run's settings, and without checkpointing (plan/activation_memory.py)."""
    from ...activations import DEVICE, HOST, PROCESS
    from ..plan.activation_memory import activation_memory
    from ..models.gpt import MODEL_PRESETS

    section = args.config.get("activation_checkpointing")
    elem = 4 if args.precision == "fp32" else 2
    shape = (MODEL_PRESETS[args.model], micro_batch, args.seq_len, elem)
    off = activation_memory(*shape)
    out = {"activation_checkpointing": section is not None, "activation_device_predicted_off": off.device}
    if section is not None:
        on = activation_memory(*shape, checkpointing=True, cpu_checkpointing=bool(section.get("cpu_checkpointing")))
        kept = PROCESS.current().kept_bytes.peak
        out.update(activation_kept_device=kept[DEVICE], activation_kept_host=kept[HOST],
                   activation_kept_device_predicted=on.kept_device, activation_kept_host_predicted=on.kept_host,
                   activation_device_predicted=on.device)
    return out
