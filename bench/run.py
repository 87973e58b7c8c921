"""Run strategies side by side (one after another, same machine, same settings) and write a table.

    python bench/run.py                       # zerodp 0-3 and every peer available here
    python bench/run.py --only zerodp2 ddp    # a subset
    python bench/run.py --model tiny --steps 3   # a smoke run

Results: bench/results/<tag>/<strategy>.json and bench/results/<tag>/summary.md. Timings are the
median of the steps after the first half (warm-up excluded); the ratio columns compare each zerodp
stage with DDP and with the peers that implement the same stage (<1 means zerodp is faster/smaller).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from strategies import PEERS_OF_STAGE, STRATEGIES  # noqa: E402

MIB = 2 ** 20


def available(name: str) -> bool:
    return not name.startswith("deepspeed") or importlib.util.find_spec("deepspeed") is not None


def run_one(name: str, args, out: Path) -> dict | None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(HERE / "bench.py"), "--strategy", name, "--model", args.model, "--steps", str(args.steps),
           "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (out.with_suffix(".log")).write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(f"  {name}: FAILED (see {out.with_suffix('.log')})")
        return None
    ranks = json.loads(out.read_text())
    half = len(ranks[0]["step_times"]) // 2
    step = max(statistics.median(r["step_times"][half:]) for r in ranks)  # the slower rank sets the pace
    states = ranks[0]["model_state_bytes"]
    return {"name": name, "step_s": step, "losses": ranks[0]["losses"],
            "state_mib": sum(states.values()) / MIB, "states": states,
            "rss_mib": max(r["peak_rss_bytes"] for r in ranks) / MIB}


def summary(rows: dict, args) -> str:
    ddp = rows.get("ddp")
    lines = [f"# zerodp vs peers: {args.model} model, {args.nproc} ranks, {args.steps} steps, gloo, "
             "OMP_NUM_THREADS=1", "",
             "| strategy | step s | vs DDP | vs best same-stage peer | model states MiB/rank | peak RSS MiB "
             "| final loss | max abs loss diff vs DDP |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        vs_ddp = f"{r['step_s'] / ddp['step_s']:.2f}" if ddp else "-"
        vs_peer = "-"
        if name.startswith("zerodp"):
            peers = [rows[p] for p in PEERS_OF_STAGE[int(name[-1])] if p in rows]
            if peers:
                best = min(peers, key=lambda p: p["step_s"])
                vs_peer = f"{r['step_s'] / best['step_s']:.2f} ({best['name']})"
        diff = max(abs(a - b) for a, b in zip(r["losses"], ddp["losses"])) if ddp else float("nan")
        lines.append(f"| {name} | {r['step_s']:.3f} | {vs_ddp} | {vs_peer} | {r['state_mib']:.1f} | "
                     f"{r['rss_mib']:.0f} | {r['losses'][-1]:.4f} | {diff:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help="strategies to run (default: all available)")
    ap.add_argument("--model", default="baseline")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--tag", default=None, help="results folder name (default: the model name)")
    args = ap.parse_args()
    names = args.only or [n for n in STRATEGIES if available(n)]
    folder = HERE / "results" / (args.tag or args.model)
    folder.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name in names:
        print(f"running {name} ...", flush=True)
        row = run_one(name, args, folder / f"{name}.json")
        if row:
            rows[name] = row
            print(f"  {name}: {row['step_s']:.3f} s/step, {row['state_mib']:.1f} MiB model states", flush=True)
    text = summary(rows, args)
    (folder / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
