"""CPU optimizer speed: one AdamW step over 100M fp32 parameters, zerodp's sharded step against torch and DeepSpeed.

    python -m bench.harness.cpu_adam --out bench/results/cpu_adam.md            (1 and 2 threads, 2 rounds)
    python -m bench.harness.cpu_adam --threads 1 --rounds 1 --variants zerodp torch_fused

Every measurement runs in a fresh process (OMP_NUM_THREADS and torch.set_num_threads set to the thread
count) so that no variant inherits another's heap. Each does one warm-up step (it creates the state),
then --steps timed steps, and reports the median. AdamW(lr=3e-4, weight_decay=0.01), the same
parameters (seeded randn) and the same gradient every step, so the final parameters of two variants
are bitwise equal exactly when their arithmetic is; the table groups variants by a digest of them.

Variants (the parameters are 25 tensors of 4M elements, a GPT-like layout, unless "one tensor"):
    torch_forloop, torch_foreach, torch_fused   torch.optim.AdamW(foreach=False / foreach=True / fused=True)
    torch_*_one                                 the same on a single 100M-element tensor
    zerodp, zerodp_foreach, zerodp_fused        zerodp.initialize (stage 1, world size 1) with the user's
                                                AdamW() / AdamW(foreach=True) / AdamW(fused=True); timed:
                                                ShardedOptimizer.step (gradient norm, chunk grads, the
                                                inner step) and the inner step alone
    zerodp_chunk<K>                             zerodp with OPTIMIZER_CHUNK_NUMEL = 2**K (default 2**18)
    deepspeed_cpu_adam                          deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True), when
                                                deepspeed imports; its op JIT-compiles on first use
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

NUMEL = 100_000_000
TENSOR_NUMEL = 4_000_000
LR, WD = 3e-4, 0.01
DEFAULT_VARIANTS = ["torch_forloop", "torch_foreach", "torch_fused", "torch_forloop_one", "torch_foreach_one",
                    "torch_fused_one", "zerodp", "zerodp_foreach", "zerodp_fused", "zerodp_chunk16",
                    "zerodp_chunk17", "zerodp_chunk19", "zerodp_chunk20", "deepspeed_cpu_adam"]
TORCH_KWARGS = {"forloop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def make_params(numel: int, one_tensor: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Seeded parameters and gradients: one tensor, or tensors of TENSOR_NUMEL elements."""
    sizes = [numel] if one_tensor else [TENSOR_NUMEL] * (numel // TENSOR_NUMEL) + (
        [numel % TENSOR_NUMEL] if numel % TENSOR_NUMEL else [])
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) * 1e-2 for n in sizes]
    return params, grads


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _timed_steps(step, steps: int) -> list[float]:
    step()  # warm-up: creates the state (and, for DeepSpeedCPUAdam, nothing is compiled here any more)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def run_torch(kind: str, one_tensor: bool, numel: int, steps: int) -> dict:
    params, grads = make_params(numel, one_tensor)
    params = [torch.nn.Parameter(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, **TORCH_KWARGS[kind])
    times = _timed_steps(opt.step, steps)
    return {"times": times, "digest": digest(params)}


def run_deepspeed(numel: int, steps: int) -> dict:
    # JIT-builds the cpu_adam op with ninja on first construction
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    params, grads = make_params(numel, False)
    params = [torch.nn.Parameter(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    t = time.perf_counter()
    opt = DeepSpeedCPUAdam(params, lr=LR, weight_decay=WD, adamw_mode=True)
    build_s = time.perf_counter() - t
    times = _timed_steps(opt.step, steps)
    return {"times": times, "digest": digest(params), "build_s": build_s}


class _SumModel(torch.nn.Module):
    """loss = sum_i <p_i, w_i>: the gradient of p_i is exactly w_i, the same as the torch variants get."""

    def __init__(self, params: list[torch.Tensor], weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(p) for p in params])
        self.weights = weights

    def forward(self) -> torch.Tensor:
        return sum(torch.dot(p, w) for p, w in zip(self.ps, self.weights))


def run_zerodp(kind: str, chunk_log2: int | None, numel: int, steps: int) -> dict:
    import zerodp

    if chunk_log2 is not None:  # no patching of zerodp's internals from the harness (issue 23)
        raise SystemExit("the zerodp_chunk<K> variants were a one-off experiment (its figures are in "
                         "bench/results/cpu_adam.md); zerodp's optimizer chunk is OPTIMIZER_CHUNK_NUMEL = 2**18")
    params, grads = make_params(numel, False)
    model = _SumModel(params, grads)
    user = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, **TORCH_KWARGS[kind])
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": 1}}
    engine = zerodp.initialize(model, user, cfg)
    inner_times: list[float] = []
    inner = engine.optimizer.optimizer
    started: list[float] = []
    # torch's own optimizer hooks time the inner step: nothing of zerodp or torch is patched
    inner.register_step_pre_hook(lambda *_: started.append(time.perf_counter()))
    inner.register_step_post_hook(lambda *_: inner_times.append(time.perf_counter() - started.pop()))
    times = []
    for i in range(steps + 1):
        engine.backward(engine())
        t = time.perf_counter()
        engine.step()
        if i > 0:  # the first step creates the state
            times.append(time.perf_counter() - t)
    result = {"times": times, "inner_times": inner_times[1:], "digest": digest(list(model.parameters())),
              "chunk_numel": engine.optimizer.chunk_numel,
              "chunks": sum(len(c) for c in engine.optimizer.chunks)}
    engine.close()
    return result


def measure(variant: str, numel: int, steps: int) -> dict:
    if variant == "deepspeed_cpu_adam":
        return run_deepspeed(numel, steps)
    if variant.startswith("torch_"):
        kind = variant.removeprefix("torch_").removesuffix("_one")
        return run_torch(kind, variant.endswith("_one"), numel, steps)
    if variant.startswith("zerodp_chunk"):
        return run_zerodp("forloop", int(variant.removeprefix("zerodp_chunk")), numel, steps)
    if variant.startswith("zerodp"):
        return run_zerodp(variant.removeprefix("zerodp").lstrip("_") or "forloop", None, numel, steps)
    raise ValueError(f"unknown variant {variant!r}")


def child(variant: str, threads: int, numel: int, steps: int) -> dict:
    """Run one measurement in a fresh interpreter with `threads` threads; the result or the error."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "bench.harness.cpu_adam", "--child", variant, "--threads", str(threads),
           "--numel", str(numel), "--steps", str(steps)]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-25:]
        return {"error": "\n".join(tail)}
    return json.loads(lines[-1].removeprefix("RESULT "))


def table(results: dict, threads: list[int], numel: int) -> str:
    """Markdown: seconds per 100M elements (median over rounds of each round's median step), ratios."""
    per100m = 1e8 / numel
    out = []
    for n in threads:
        rows = {v: r for (v, t), r in results.items() if t == n}
        ok = {v: r for v, r in rows.items() if r and "error" not in r[0]}

        def sec(v, key="times", ok=ok):
            return statistics.median(statistics.median(r[key]) for r in ok[v]) * per100m

        best_torch = min((sec(v), v) for v in ("torch_foreach", "torch_fused") if v in ok) if \
            any(v in ok for v in ("torch_foreach", "torch_fused")) else None
        ref = ok.get("torch_forloop", [{}])[0].get("digest")
        out.append(f"\n### {n} thread{'s' if n > 1 else ''}\n")
        out.append("| variant | s per 100M | inner step s per 100M | x faster torch (fused/foreach, 25 tensors) "
                   "| chunks | final params == torch for-loop |")
        out.append("|---|---|---|---|---|---|")
        for v, r in rows.items():
            if v not in ok:
                first = r[0]["error"].strip().splitlines()[-1] if r else "not run"
                out.append(f"| {v} | failed: `{first[:160]}` | | | | |")
                continue
            inner = f"{sec(v, 'inner_times'):.3f}" if "inner_times" in ok[v][0] else ""
            ratio = f"{sec(v) / best_torch[0]:.2f} ({best_torch[1]})" if best_torch else ""
            chunks = f"{ok[v][0]['chunks']} x {ok[v][0]['chunk_numel']}" if "chunks" in ok[v][0] else ""
            same = "yes" if ok[v][0]["digest"] == ref else "no"
            out.append(f"| {v} | {sec(v):.3f} | {inner} | {ratio} | {chunks} | {same} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    ap.add_argument("--numel", type=int, default=NUMEL)
    ap.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up step")
    ap.add_argument("--rounds", type=int, default=2, help="each round runs every variant once, alternating")
    ap.add_argument("--out", help="write the markdown table here (and the raw results next to it as .json)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        torch.set_num_threads(args.threads[0])
        print("RESULT " + json.dumps(measure(args.child, args.numel, args.steps)), flush=True)
        return
    results: dict = {}
    for rnd in range(args.rounds):
        for n in args.threads:
            for v in args.variants:
                r = child(v, n, args.numel, args.steps)
                results.setdefault((v, n), []).append(r)
                shown = r["error"].splitlines()[-1] if "error" in r else \
                    f"{statistics.median(r['times']):.3f}s/step ({args.numel / 1e6:.0f}M) digest {r['digest']}"
                print(f"round {rnd} threads {n} {v}: {shown}", flush=True)
    cmd = "python -m bench.harness.cpu_adam " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (f"# CPU AdamW step over {args.numel / 1e6:.0f}M fp32 parameters\n\n`{cmd}`; {platform.machine()}, "
            f"{os.cpu_count()} cores, torch {torch.__version__}; median of {args.steps} timed steps, median over "
            f"{args.rounds} alternating rounds.\n" + table(results, args.threads, args.numel))
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(
            json.dumps([{"variant": v, "threads": n, "runs": r} for (v, n), r in results.items()], indent=1))


if __name__ == "__main__":
    main()
