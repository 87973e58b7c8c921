"""`python -m bench.harness` (`make bench`): run strategies side by side in alternating rounds and report them as ratios.

Each round runs every strategy once, one after another (one torchrun job each), so that a drift of
the machine during the run touches every strategy alike; odd rounds run them in reverse order, so
that no strategy always runs early or late in a round (on this 2-core VM the speed wanders by 10-15%
within minutes: a fixed order once showed DDP's own arithmetic, zerodp0, at 0.92x DDP). A strategy's
figure is the median over rounds, and each time ratio (to DDP, to the best peer of its stage) is the
median of the per-round ratios. Results go to `<out>/<strategy>-r<round>.json`, a table to `<results>`
(bench/RESULTS.md) with the exact command, and a chart next to it. `--interleaved` instead steps every
strategy in turn inside one process pair (interleaved.py: step-time ratios taken seconds apart, no
memory figures). `--sweep` trains zerodp's stages at world sizes 1, 2 and 4 for a few steps
(oversubscribing cores is fine: it measures memory) and plots model-state bytes per rank
against the ZeRO formula.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

from . import host_profile
from .models import BENCH_MODELS

ROOT = Path(__file__).resolve().parents[2]  # the checkout: the harness is not part of the installed package
from .strategies import STRATEGIES

MIB = 2 ** 20
PEERS = ["ddp", "torch_zero1", "fsdp1_grad_op", "fsdp1_full", "fsdp2"] + [f"deepspeed{s}" for s in range(4)]
# Which peers answer which ZeRO stage (for the "vs same-stage peer" column).
PEERS_OF_STAGE = {0: ["ddp", "deepspeed0"], 1: ["torch_zero1", "deepspeed1"],
                  2: ["fsdp1_grad_op", "deepspeed2"], 3: ["fsdp1_full", "fsdp2", "deepspeed3"]}


def _env() -> dict:
    """The workers' environment: one thread each, and this checkout importable (`-m bench.harness.worker`)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)


def available(name: str) -> bool:
    return not name.startswith("deepspeed") or importlib.util.find_spec("deepspeed") is not None


def run_worker(name: str, model: str, steps: int, world: int, out: Path) -> Optional[list[dict]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           "-m", "bench.harness.worker", "--strategy", name, "--model", model, "--steps", str(steps),
           "--out", str(out)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    out.with_suffix(".log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(f"  {name}: FAILED (see {out.with_suffix('.log')})", flush=True)
        return None
    return json.loads(out.read_text())


def _step_s(ranks: list[dict]) -> float:
    half = len(ranks[0]["step_times"]) // 2  # the first half is warm-up
    return max(statistics.median(r["step_times"][half:]) for r in ranks)  # the slower rank sets the pace


def _mib(value) -> Optional[float]:
    return None if value is None else value / MIB


def _ratios(rounds: list[list[dict]], baseline: list[list[dict]]) -> list[float]:
    """Per-round step-time ratios of one strategy to another (same round, so the same machine state)."""
    return [_step_s(r) / _step_s(b) for r, b in zip(rounds, baseline)]


def aggregate(runs: dict[str, list[list[dict]]], micro_batch: int, seq: int) -> dict[str, dict]:
    """Per strategy: medians over rounds of time, ratio to DDP (per round), memory, and loss agreement."""
    rows = {}
    ddp = runs.get("ddp")
    for name, rounds in runs.items():
        times = [_step_s(r) for r in rounds]
        ratios = _ratios(rounds, ddp) if ddp else []
        first = rounds[0][0]
        world = first["world_size"]
        diffs = [abs(a - b) for a, b in zip(first["losses"], ddp[0][0]["losses"])] if ddp else []
        live = [max(x["peak_live_bytes"] or 0 for x in r) for r in rounds]
        rows[name] = {
            "step_s": statistics.median(times), "x_ddp": statistics.median(ratios) if ratios else None,
            "tokens_per_s": world * micro_batch * seq / statistics.median(times),
            "live_mib": _mib(statistics.median(live)) if any(live) else None,
            "rss_mib": _mib(statistics.median(max(x["peak_rss_bytes"] for x in r) for r in rounds)),
            "state_mib": _mib(sum(first["model_state_bytes"].values())),
            "predicted_mib": _mib(sum(first["predicted_state_bytes"].values()))
            if first.get("predicted_state_bytes") else None,
            "traffic_mib": _mib(first.get("traffic_bytes_per_step")),
            "loss_diff": max(diffs) if diffs else None, "final_loss": first["losses"][-1],
        }
    for name, row in rows.items():  # vs the fastest peer of a zerodp stage: the highest median per-round ratio
        peers = [p for p in PEERS_OF_STAGE.get(int(name[6]), []) if p in runs] if name.startswith("zerodp") else []
        vs = {p: statistics.median(_ratios(runs[name], runs[p])) for p in peers}
        row["vs_peer"] = max(vs.items(), key=lambda kv: kv[1]) if vs else None
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _agreement(loss_diff: Optional[float]) -> str:
    """The losses-vs-DDP cell: identical (bitwise), or the largest difference."""
    return "-" if loss_diff is None else ("identical" if loss_diff == 0 else f"max diff {loss_diff:.1e}")


def table(rows: dict[str, dict]) -> str:
    lines = ["| strategy | step s | x DDP | x best same-stage peer | tokens/s | peak live MiB/rank | "
             "peak RSS MiB/rank | model states MiB/rank (formula) | traffic MiB/step | losses vs DDP |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        vs_peer = "-" if r["vs_peer"] is None else f"{r['vs_peer'][1]:.2f} ({r['vs_peer'][0]})"
        states = _fmt(r["state_mib"], ".1f") + (f" ({r['predicted_mib']:.1f})" if r["predicted_mib"] else "")
        losses = _agreement(r["loss_diff"])
        lines.append(f"| {name} | {r['step_s']:.3f} | {_fmt(r['x_ddp'], '.2f')} | {vs_peer} | "
                     f"{r['tokens_per_s']:.0f} | {_fmt(r['live_mib'], '.0f')} | {_fmt(r['rss_mib'], '.0f')} | "
                     f"{states} | {_fmt(r['traffic_mib'], '.1f')} | {losses} |")
    return "\n".join(lines) + "\n"


def chart(rows: dict[str, dict], path: Path, title: str) -> Optional[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(rows)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 4.8))
    ax_t.barh(names, [rows[n]["x_ddp"] or 0 for n in names], color=["C0" if n.startswith("zerodp") else "C7"
                                                                      for n in names])
    ax_t.axvline(1.0, color="k", lw=0.8)
    ax_t.set_xlabel("step time / DDP's (lower is better)")
    ax_t.invert_yaxis()
    y = range(len(names))
    ax_m.barh([i - 0.2 for i in y], [rows[n]["live_mib"] or 0 for n in names], height=0.4, label="peak live")
    ax_m.barh([i + 0.2 for i in y], [rows[n]["rss_mib"] or 0 for n in names], height=0.4, label="peak RSS")
    ax_m.set_yticks(list(y), names)
    ax_m.invert_yaxis()
    ax_m.set_xlabel("MiB per rank (lower is better)")
    ax_m.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _machine() -> str:
    import torch

    return f"{os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}, gloo, OMP_NUM_THREADS=1"


def compare(args) -> None:
    names = args.strategies or ([n for n in PEERS if available(n)] + [f"zerodp{s}" for s in args.stages])
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise SystemExit(f"bench: unknown strategies {unknown}; choose from {sorted(STRATEGIES)}")
    out = Path(args.out or ROOT / f"bench/results/{args.model}-{args.world_size}ranks")
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):  # every strategy once per round; see the docstring
            print(f"round {r + 1}/{args.rounds}: {name} ...", flush=True)
            ranks = run_worker(name, args.model, args.steps, args.world_size, out / f"{name}-r{r}.json")
            if ranks is not None:
                runs[name].append(ranks)
    failed = [n for n, v in runs.items() if len(v) != args.rounds]
    runs = {n: v for n, v in runs.items() if len(v) == args.rounds}
    cfg = BENCH_MODELS[args.model]
    rows = aggregate(runs, 4, cfg.block_size)
    text = table(rows)
    (out / "summary.md").write_text(text)
    title = f"{args.model} GPT, {args.world_size} ranks, median of {args.rounds} rounds"
    png = chart(rows, out / "chart.png", title)
    command = "python -m bench.harness " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    rel_png = os.path.relpath(png, results.parent) if png else None
    results.write_text(f"# zerodp vs peers\n\n`{command}` on {_machine()}; {title}, {args.steps} timed steps "
                       f"(second half timed).\n\n" + text + (f"\n![chart]({rel_png})\n" if rel_png else "")
                       + "\nPeak live = malloc in-use bytes sampled every 1 ms during 2 extra steps; traffic = the "
                         "paper's volume of zerodp's collectives (an all-reduce counts twice its buffer); "
                         "formula = the ZeRO paper's model-state bytes for this rank.\n")
    print(text)
    if failed:  # the table above lacks them: say so and fail, never a silently shorter table
        raise SystemExit(f"bench: {', '.join(failed)} failed in some round; their logs are in {out}")
    print(f"wrote {results}" + (f" and {png}" if png else ""))


def interleaved_rows(ranks: list[dict]) -> dict[str, dict]:
    """Per strategy: median step time and median per-step ratio to DDP over the timed steps (the first
    third is warm-up; a step's time is the slower rank's), CPU seconds per step and rank, loss agreement."""
    names = list(ranks[0]["step_times"])
    steps = len(ranks[0]["step_times"][names[0]])
    timed = range(steps // 3, steps)
    wall = {n: [max(r["step_times"][n][i] for r in ranks) for i in range(steps)] for n in names}
    losses = ranks[0]["losses"]
    rows = {}
    for n in names:
        rows[n] = {
            "step_s": statistics.median(wall[n][i] for i in timed),
            "x_ddp": statistics.median(wall[n][i] / wall["ddp"][i] for i in timed) if "ddp" in wall else None,
            "cpu_s": statistics.median(sum(r["cpu_times"][n][i] for r in ranks) / len(ranks) for i in timed),
            "loss_diff": max(abs(a - b) for a, b in zip(losses[n], losses["ddp"])) if "ddp" in losses else None,
        }
    return rows


def interleaved(args) -> None:
    """Run bench/interleaved.py once on `--world-size` ranks and write its table to `--results`."""
    names = args.strategies or ([n for n in PEERS if not n.startswith("deepspeed")]
                                + [f"zerodp{s}" for s in args.stages])
    if any(n.startswith("deepspeed") for n in names):
        raise SystemExit("bench --interleaved: DeepSpeed cannot share a process with the other strategies "
                         "(its initialize changes process-wide state); measure it with the rounds (no --interleaved)")
    out = Path(args.out or ROOT / f"bench/results/{args.model}-{args.world_size}ranks-interleaved")
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world_size}",
           "-m", "bench.harness.interleaved", "--strategies", *names, "--model", args.model,
           "--steps", str(args.steps), "--out", str(out / "interleaved.json")]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    (out / "interleaved.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"bench --interleaved: the run failed (see {out / 'interleaved.log'})")
    rows = interleaved_rows(json.loads((out / "interleaved.json").read_text()))
    lines = ["| strategy | step s | x DDP (median per-step ratio) | CPU s/step/rank | losses vs DDP |",
             "|---|---|---|---|---|"]
    for n, r in rows.items():
        lines.append(f"| {n} | {r['step_s']:.3f} | {_fmt(r['x_ddp'], '.3f')} | {r['cpu_s']:.3f} | "
                     f"{_agreement(r['loss_diff'])} |")
    text = "\n".join(lines) + "\n"
    command = "python -m bench.harness " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(f"# zerodp vs peers, interleaved\n\n`{command}` on {_machine()}; {args.model} GPT, "
                       f"{args.world_size} ranks, every strategy in one process pair, {args.steps} steps each "
                       f"stepped in turn (the last two thirds timed).\n\n" + text)
    print(text)
    print(f"wrote {results}")


def sweep(args) -> None:
    """Model-state bytes per rank at world sizes 1, 2, 4, measured and predicted, per stage."""
    out = Path(args.out or ROOT / f"bench/results/{args.model}-sweep")
    out.mkdir(parents=True, exist_ok=True)
    points = []
    for world in (1, 2, 4):
        for stage in args.stages:
            ranks = run_worker(f"zerodp{stage}", args.model, 2, world, out / f"zerodp{stage}-w{world}.json")
            if ranks:
                measured = max(sum(r["model_state_bytes"].values()) for r in ranks) / MIB
                predicted = max(sum(r["predicted_state_bytes"].values()) for r in ranks) / MIB
                points.append({"world": world, "stage": stage, "measured_mib": measured, "predicted_mib": predicted})
    lines = ["| stage | world size | measured MiB/rank | formula MiB/rank |", "|---|---|---|---|"]
    lines += [f"| {p['stage']} | {p['world']} | {p['measured_mib']:.1f} | {p['predicted_mib']:.1f} |" for p in points]
    text = "\n".join(lines) + "\n"
    (out / "sweep.md").write_text(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for stage in args.stages:
            ps = [p for p in points if p["stage"] == stage]
            ax.plot([p["world"] for p in ps], [p["predicted_mib"] for p in ps], "--", color=f"C{stage}")
            ax.plot([p["world"] for p in ps], [p["measured_mib"] for p in ps], "o", color=f"C{stage}",
                    label=f"stage {stage}")
        ax.set_xlabel("world size")
        ax.set_ylabel("model states MiB per rank (dashed: formula)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "sweep.png", dpi=110)
    except ImportError:
        pass
    print(text)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="baseline", choices=sorted(BENCH_MODELS), help="benchmark GPT")
    ap.add_argument("--world-size", type=int, default=2, help="ranks (processes) per run")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run (the first half is warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; figures are medians over them")
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], help="zerodp stages to run")
    ap.add_argument("--strategies", nargs="+", default=None,
                    help=f"run exactly these (default: every peer available and the stages); from {sorted(STRATEGIES)}")
    ap.add_argument("--out", default=None, help="folder for per-run JSON and logs")
    ap.add_argument("--results", default=str(ROOT / "bench" / "RESULTS.md"), help="the Markdown report to write")
    ap.add_argument("--sweep", action="store_true", help="memory per rank at world sizes 1, 2, 4 vs the formula")
    ap.add_argument("--interleaved", action="store_true",
                    help="step time only: every strategy in one pair of processes, stepped in turn, so that "
                         "machine drift cannot skew the ratios (bench/interleaved.py); --steps per strategy")
    ap.add_argument("--host-profile", action="store_true",
                    help="the CPU proxy of host overhead: self CPU per step of a deep narrow GPT under torch.profiler "
                         "(host_profile.py); results to bench/results/host_profile.md unless --results")
    host_profile.add_arguments(ap)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.harness", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    run(args)
    return 0


def run(args) -> None:
    """The mode `args` asks for: the sweep, the interleaved timing, or the rounds (the default)."""
    if args.host_profile:
        if args.results == str(ROOT / "bench" / "RESULTS.md"):
            args.results = str(ROOT / "bench" / "results" / "host_profile.md")
        args.strategies = args.strategies or host_profile.STRATEGY_NAMES
        host_profile.run(args)
    elif args.sweep:
        sweep(args)
    elif args.interleaved:
        interleaved(args)
    else:
        compare(args)
