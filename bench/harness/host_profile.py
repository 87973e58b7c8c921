"""The CPU proxy of the GPU step's host overhead (issue 32): `python -m bench.harness --host-profile`.

On one GPU the step of a 254M GPT is host-bound: the CUDA work is no larger than DDP's, but the
Python around it (gradient hooks per parameter, views, communication records) costs more than the
kernels. A deep, narrow GPT on the CPU (32 layers x width 32, batch 2 x 16 tokens, world 1 over
gloo) has kernels so small that the same host work dominates, so it is measured here without a GPU:
torch.profiler over `--host-steps` steps (after warm-up) in a fresh process per strategy, and per step:

    total self CPU             every profiled event's self time, summed
    AccumulateGrad self CPU    gradient accumulation, and the Python post-accumulate-grad hooks
                               that run inside it (Python frames are not events: their time is
                               the node's own); DDP's C++ reducer hooks show almost nothing here
    record_param_comms         torch's per-collective record (one per collective issued)
    view ops                   aten::slice/split/narrow/as_strided/view/select (views made per step)

zerodp stages 0-3 run beside DDP and FSDP2 (fully_shard per block and root); with `--baseline-src
DIR` (another checkout's src/, e.g. a `git worktree` of the base commit) zerodp's stages also run
from that tree in the same invocation, so before/after ratios come from one run side by side.
Collectives are real world-1 gloo calls (ZERODP_REAL_COLLECTIVES=1), as in the GPU measurement.

[Note: the accelerator's gradient policy] At stages 2-3 the gradient hooks run one of two policies, decided by the
device (`zerodp.offload.placement.grad_views_every_round`): on a GPU each round's gradient buffer is zeroed and handed to
autograd as views (a memset beside the kernels saves a copy and a `.grad` reset per parameter on the host); on
the CPU each gradient is copied in (the zeroing would cost a large CPU model two more passes over its gradients).
This proxy stands for the GPU's host work, so its `zerodpN` rows run the GPU's policy on the CPU (the device's
answer patched in the child process); `--host-grad-views both` (the default) adds `zerodpN (CPU policy)` rows for
stages 2-3, what a CPU run of this tree does. The baseline tree has one policy, and runs it.

[Note: a shared machine] The profiler's times are wall-clock: a process preempted inside an event
has the wait counted as that event's self time, and on a loaded machine that noise is larger than
the effect measured (AccumulateGrad of one strategy varied 2-10x between runs at a load average of
25 on 2 cores). So every step is profiled on its own, a figure is the minimum over the steps
(noise only adds; medians are kept in the JSON), and `--host-repeats` runs every process that many
times, interleaving the two trees, keeping each figure's minimum.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STRATEGY_NAMES = ["ddp", "fsdp2", "zerodp0", "zerodp1", "zerodp2", "zerodp3"]
VIEW_OPS = ("aten::slice", "aten::split", "aten::narrow", "aten::as_strided", "aten::view", "aten::select",
            "aten::split_with_sizes", "aten::unflatten", "aten::alias")
WARMUP_STEPS = 2


def proxy_config():
    from zerodp.tools.models.gpt import GPTConfig

    # deep and narrow: 324 parameters, 0.4M elements, kernels of microseconds
    return GPTConfig(vocab_size=256, block_size=16, n_layer=32, n_head=4, n_embd=32, tie_embeddings=False)


def profile_one(strategy: str, steps: int, micro_batch: int, accelerator_policy: bool = False) -> dict:
    """One strategy in this process: warm up, then profile `steps` steps; self-CPU figures per step (ms).
    `accelerator_policy`: zerodp's device-dependent choices as on a GPU ([Note: the accelerator's gradient policy])."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from zerodp.tools.models.gpt import GPT
    from .models import synthetic_tokens
    from .strategies import STRATEGIES

    torch.set_num_threads(1)
    if accelerator_policy:  # never asked of the baseline tree, which has one policy
        import zerodp.offload.placement
        zerodp.offload.placement.grad_views_every_round = lambda device: True
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        cfg = proxy_config()
        torch.manual_seed(0)
        model = GPT(cfg)
        runner = STRATEGIES[strategy](model)
        batches = [synthetic_tokens(s, 0, micro_batch, cfg.block_size, cfg.vocab_size)
                   for s in range(WARMUP_STEPS + steps)]

        def step(tokens) -> float:
            logits = runner.forward(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
            runner.backward(loss)
            runner.step()
            return loss.item()

        losses, wall, per_step = [], [], []
        for tokens in batches[:WARMUP_STEPS]:
            losses.append(step(tokens))
        for tokens in batches[WARMUP_STEPS:]:  # one profile per step: see [Note: a shared machine]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                losses.append(step(tokens))
                wall.append(time.perf_counter() - t0)
            per_step.append(prof.key_averages())
        del runner, model
        import gc
        gc.collect()  # DDP's reducer must go before its process group
        dist.destroy_process_group()

    def self_ms(match) -> list[float]:
        return [sum(e.self_cpu_time_total for e in events if match(e.key)) / 1e3 for events in per_step]

    def calls(match) -> float:
        return statistics.median(sum(e.count for e in events if match(e.key)) for events in per_step)

    metrics = {"total_self_cpu": lambda k: True, "accumulate_grad": lambda k: k == "torch::autograd::AccumulateGrad",
               "record_param_comms": lambda k: k == "record_param_comms", "view_ops": lambda k: k in VIEW_OPS}
    out = {"strategy": strategy, "steps": steps, "losses": losses, "torch": torch.__version__,
           "wall_ms_median": statistics.median(wall) * 1e3, "wall_ms_min": min(wall) * 1e3}
    for name, match in metrics.items():
        per = self_ms(match)
        out[f"{name}_ms"], out[f"{name}_ms_median"] = min(per), statistics.median(per)
        out[f"{name}_calls"] = calls(match)
    totals: dict[str, list] = {}
    for events in per_step:
        for e in events:
            t = totals.setdefault(e.key, [0.0, 0])
            t[0] += e.self_cpu_time_total / 1e3 / steps
            t[1] += e.count / steps
    out["top"] = sorted(((k, ms, n) for k, (ms, n) in totals.items()), key=lambda t: -t[1])[:12]
    return out


def run_child(strategy: str, steps: int, micro_batch: int, src: Path | None, accelerator_policy: bool) -> dict:
    """`profile_one` in a fresh process (clean allocator and hooks); `src`: import zerodp from there."""
    path = [str(src)] if src else []
    env = dict(os.environ, OMP_NUM_THREADS="1", ZERODP_REAL_COLLECTIVES="1",
               PYTHONPATH=os.pathsep.join(path + [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "bench.harness.host_profile", "--child", strategy, "--steps", str(steps),
               "--micro-batch", str(micro_batch), "--json", out.name] + (["--accelerator-policy"] * accelerator_policy)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"host profile of {strategy} failed:\n{proc.stdout}\n{proc.stderr}")
        return json.loads(Path(out.name).read_text())


def table(rows: list[dict], ddp_total: float) -> str:
    lines = ["| strategy | total self CPU ms/step | AccumulateGrad ms/step (calls) | % of DDP total | "
             "record_param_comms ms (calls) | view ops ms (calls) | wall ms/step |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['total_self_cpu_ms']:.2f} | {r['accumulate_grad_ms']:.3f} "
                     f"({r['accumulate_grad_calls']:.0f}) | {100 * r['accumulate_grad_ms'] / ddp_total:.2f}% | "
                     f"{r['record_param_comms_ms']:.3f} ({r['record_param_comms_calls']:.0f}) | "
                     f"{r['view_ops_ms']:.2f} ({r['view_ops_calls']:.0f}) | {r['wall_ms_min']:.1f} |")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> str:
    """zerodp stage by stage: this tree's figure over the baseline tree's, from the same run."""
    by = {r["label"]: r for r in rows}
    out = ["| stage | AccumulateGrad after/before | total self CPU after/before |", "|---|---|---|"]
    for s in range(4):
        a, b = by.get(f"zerodp{s}"), by.get(f"zerodp{s} (baseline)")
        if a and b:
            out.append(f"| {s} | {a['accumulate_grad_ms'] / max(b['accumulate_grad_ms'], 1e-9):.3f} | "
                       f"{a['total_self_cpu_ms'] / b['total_self_cpu_ms']:.3f} |")
    return "\n".join(out) if len(out) > 2 else ""


def run(args) -> None:
    """Every strategy (and with --baseline-src, zerodp's stages from that tree), a table to `args.results`."""
    rows = []
    baseline = Path(args.baseline_src).resolve() if args.baseline_src else None
    plan = []
    policies = {"accelerator": [True], "device": [False], "both": [True, False]}[args.host_grad_views]
    for name in args.strategies:  # each zerodp stage beside its baseline, so both meet the same machine state
        for accelerator in policies if name in ("zerodp2", "zerodp3") else policies[:1]:
            cpu_row = not accelerator and len(policies) == 2
            plan.append((name, None, f"{name} (CPU policy)" if cpu_row else name, accelerator))
        if baseline and name.startswith("zerodp"):
            plan.append((name, baseline, f"{name} (baseline)", False))
    best: dict[str, dict] = {}
    for repeat in range(args.host_repeats):
        for name, src, label, accelerator in plan:
            print(f"host profile: {label} (run {repeat + 1} of {args.host_repeats})", flush=True)
            row = run_child(name, args.host_steps, args.host_micro_batch, src, accelerator)
            row["label"] = label
            if label in best:  # each figure's minimum over the runs ([Note: a shared machine])
                for key, value in row.items():
                    if key.endswith("_ms") or key == "wall_ms_min":
                        row[key] = min(value, best[label][key])
            best[label] = row
    rows = [best[label] for _, _, label, _ in plan]
    ddp_total = next((r["total_self_cpu_ms"] for r in rows if r["strategy"] == "ddp"), float("nan"))
    cfg = proxy_config()
    cmd = "python -m bench.harness " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    text = ["# Host-overhead CPU proxy (issue 32)", "",
            f"Command: `{cmd}` (from the checkout root)", "",
            f"GPT {cfg.n_layer} layers x width {cfg.n_embd}, batch {args.host_micro_batch} x {cfg.block_size}, world 1 "
            f"(gloo, real collectives), fp32 AdamW; torch.profiler over {args.host_steps} steps after {WARMUP_STEPS} "
            f"warm-up, one process per strategy, {args.host_repeats} run(s) each; figures are per step, the minimum "
            f"over steps and runs (host_profile.py's [Note: a shared machine]). torch {rows[0]['torch']}, "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end. Gradient policy of zerodp's "
            f"stages 2-3: {POLICY_TEXT[args.host_grad_views]} (host_profile.py's [Note: the accelerator's gradient "
            f"policy]).", "",
            table(rows, ddp_total), ""]
    r = ratios(rows)
    if r:
        text += [f"zerodp: this tree over the baseline tree ({baseline}), same run:", "", r, ""]
    text += ["Top self-CPU events per strategy (ms/step, calls/step):", ""]
    for row in rows:
        text.append(f"- {row['label']}: " + ", ".join(f"{k} {ms:.2f} ({n:.0f})" for k, ms, n in row["top"][:8]))
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text("\n".join(text) + "\n")
    Path(args.results).with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print("\n".join(text))


POLICY_TEXT = {"accelerator": "a GPU's (round buffers handed to autograd as views), patched in on this CPU",
               "device": "this machine's own (the CPU copies each gradient in)",
               "both": "`zerodpN` rows run a GPU's (round buffers handed to autograd as views), patched in on this "
                       "CPU; `(CPU policy)` rows this machine's own (each gradient copied in)"}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--host-steps", dest="host_steps", type=int, default=3, help="profiled steps (after warm-up)")
    ap.add_argument("--host-micro-batch", dest="host_micro_batch", type=int, default=2, help="sequences per step")
    ap.add_argument("--host-repeats", type=int, default=1, help="runs per process; figures are minima over them")
    ap.add_argument("--baseline-src", default=None, help="another checkout's src/ whose zerodp also runs")
    ap.add_argument("--host-grad-views", choices=sorted(POLICY_TEXT), default="both",
                    help="stages 2-3: run the GPU's gradient policy on the CPU (accelerator), the CPU's own (device), "
                         "or both (see the note on the accelerator's gradient policy)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", required=True, choices=STRATEGY_NAMES)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--json", required=True)
    ap.add_argument("--accelerator-policy", action="store_true")
    args = ap.parse_args(argv)
    Path(args.json).write_text(json.dumps(profile_one(args.child, args.steps, args.micro_batch,
                                                      args.accelerator_policy)))


if __name__ == "__main__":
    main()
