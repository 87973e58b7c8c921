"""`make bench-gpu`: zerodp's stages beside DDP, FSDP2 and DeepSpeed on one GPU, bf16, AdamW (issue 32).

    python -m bench.gpu_bench                 # one CUDA GPU: 254M and 1.3B, every strategy (~5 minutes on an H100)
    python -m bench.gpu_bench --tiny          # a tiny GPT on the CPU (gloo): checks that every path runs

Each (model, strategy) runs in its own process, one rank (world 1, NCCL; gloo with --tiny), so that
its peak CUDA bytes are its own; zerodp issues its collectives for real at world 1
(ZERODP_REAL_COLLECTIVES=1, as tests/gpu does). Per run: WARMUP_STEPS steps, then the median of
TIMED_STEPS, each ended by a device synchronize. Figures: s/step, tokens/s, model TFLOPS (6 N + 12 L d T
flops per token, N parameters, L layers, d width, T sequence length: forward and backward, no
recomputation) and the peak of torch.cuda.max_memory_allocated over the timed steps (model states
included). The table goes to bench/results/gpu_bench-<device>.md (with the command) and .json.

Strategies, each as its documentation recommends (the issue's table):
    ddp              fp32 parameters under torch.autocast(bf16), fused AdamW
    fsdp2            fully_shard per Block and the root, MixedPrecisionPolicy(bf16, reduce fp32), fused AdamW
    fsdp2_offload    the same with CPUOffloadPolicy (torch's fused AdamW steps on the CPU)
    zerodp1-3        zerodp's bf16 config, a plain AdamW passed in (zerodp picks the fused kernel itself)
    zerodp3_offload  stage 3 with offload_optimizer cpu
    deepspeed1/3     DeepSpeed's bf16 config with the same fused torch AdamW as client optimizer (if importable)
A strategy that fails (an import, out of memory, a crash) is reported as such; the others still run.
`--budget-s` stops starting new runs when the whole benchmark would exceed the device time at hand.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARMUP_STEPS, TIMED_STEPS = 3, 8
LR = 1e-4
# name: (layers, width, heads, micro-batch, sequence); vocab 50304 and tied embeddings (GPT-2 sizes)
SIZES = {"254m": (16, 1024, 16, 8, 1024), "1.3b": (24, 2048, 16, 4, 1024), "tiny": (2, 64, 4, 2, 32)}
VOCAB = {"254m": 50304, "1.3b": 50304, "tiny": 256}
# most telling first, so that a cut budget loses the least
PLAN = [("1.3b", s) for s in ("ddp", "fsdp2", "zerodp1", "zerodp3", "zerodp2", "deepspeed1", "deepspeed3")] + \
       [("254m", s) for s in ("ddp", "zerodp1", "zerodp3", "fsdp2", "zerodp2", "fsdp2_offload", "zerodp3_offload",
                              "deepspeed1", "deepspeed3")]
STRATEGIES = ["ddp", "fsdp2", "fsdp2_offload", "zerodp1", "zerodp2", "zerodp3", "zerodp3_offload",
              "deepspeed1", "deepspeed3"]


def model_config(size: str):
    from zerodp.tools.models.gpt import GPTConfig

    layers, width, heads, _, seq = SIZES[size]
    return GPTConfig(vocab_size=VOCAB[size], block_size=seq, n_layer=layers, n_head=heads, n_embd=width,
                     tie_embeddings=True)


def build(strategy: str, model, device):
    """(forward, backward, step) of `strategy` around `model` (on `device` unless the strategy places it)."""
    import torch

    cuda = device.type == "cuda"
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model.to(device)
        wrapped = DDP(model, device_ids=[device.index] if cuda else None)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=cuda)

        def forward(x):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return wrapped(x)
        return forward, lambda loss: loss.backward(), _plain_step(opt)
    if strategy.startswith("fsdp2"):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        offload = strategy.endswith("_offload")
        model.to(device)
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if offload:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=cuda)  # pinning needs an accelerator
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        # fused on either device: the CPU-offloaded state steps with torch's fused CPU AdamW, its fastest
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        return model, lambda loss: loss.backward(), _plain_step(opt)
    if strategy.startswith("zerodp"):
        import zerodp

        stage = int(strategy[len("zerodp")])
        zero = {"stage": stage}
        if strategy.endswith("_offload"):
            zero["offload_optimizer"] = {"device": "cpu"}
        model.to(device)
        engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR),
                                   {"bf16": {"enabled": True}, "zero_optimization": zero})
        return engine, engine.backward, engine.step
    if strategy.startswith("deepspeed"):
        import deepspeed

        model.to(device)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": int(strategy[-1])}, "steps_per_print": 10 ** 9}
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=cuda)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        return engine, engine.backward, engine.step
    raise ValueError(f"unknown strategy {strategy!r}; one of {STRATEGIES}")


def _plain_step(opt):
    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def run_one(strategy: str, size: str, tiny_steps: bool) -> dict:
    """One strategy at one size in this process (a one-rank group); its figures as a dict."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from zerodp.tools.models.gpt import GPT

    cuda = torch.cuda.is_available() and size != "tiny"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    layers, width, _, batch, seq = SIZES[size]
    cfg = model_config(size)
    warmup, timed = (1, 2) if tiny_steps else (WARMUP_STEPS, TIMED_STEPS)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        torch.manual_seed(0)
        with device:  # built where it trains: a 1.3B model initialised on the CPU would cost seconds
            model = GPT(cfg)
        numel = sum(p.numel() for p in model.parameters())
        forward, backward, step = build(strategy, model, device)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(cfg.vocab_size, (batch, seq + 1), generator=g).to(device)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        times, losses = [], []
        for i in range(warmup + timed):
            if i == warmup and cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            logits = forward(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
            backward(loss)
            step()
            sync()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        dist.destroy_process_group()
    step_s = statistics.median(times[warmup:])
    tokens_per_step = batch * seq
    flops_per_token = 6 * numel + 12 * layers * width * seq
    return {"strategy": strategy, "size": size, "params": numel, "batch": batch, "seq": seq,
            "step_s": step_s, "tokens_per_s": tokens_per_step / step_s,
            "tflops": flops_per_token * tokens_per_step / step_s / 1e12,
            "peak_cuda_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "losses": losses, "step_times": times,
            "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "torch": torch.__version__}


def run_child(strategy: str, size: str, tiny_steps: bool, timeout_s: float) -> dict:
    """`run_one` in a fresh process; a failure or a timeout comes back as {"error": ...}."""
    env = dict(os.environ, ZERODP_REAL_COLLECTIVES="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)] +
                                          [p for p in [os.environ.get("PYTHONPATH")] if p]))
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "bench.gpu_bench", "--child", strategy, "--size", size, "--json", out.name]
        cmd += ["--tiny-steps"] if tiny_steps else []
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"strategy": strategy, "size": size, "error": f"timed out after {timeout_s:.0f} s"}
        if proc.returncode != 0:
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            errors = [ln for ln in lines if "Error" in ln or "Exception" in ln]  # the exception's own line
            return {"strategy": strategy, "size": size, "error": (errors or lines or [f"exit {proc.returncode}"])[-1]}
        return json.loads(Path(out.name).read_text())


def available(strategy: str) -> bool:
    import importlib.util

    return not strategy.startswith("deepspeed") or importlib.util.find_spec("deepspeed") is not None


def table(rows: list[dict]) -> str:
    lines = ["| model | strategy | s/step | x DDP | tokens/s | model TFLOPS | peak CUDA GiB |", "|---|---|---|---|---|---|---|"]
    ddp = {r["size"]: r["step_s"] for r in rows if r["strategy"] == "ddp" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['strategy']} | failed: {r['error'][:160]} | | | | |")
            continue
        x = f"{r['step_s'] / ddp[r['size']]:.2f}" if r["size"] in ddp else "-"
        peak = f"{r['peak_cuda_bytes'] / 2 ** 30:.2f}" if r["peak_cuda_bytes"] is not None else "-"
        lines.append(f"| {r['size']} | {r['strategy']} | {r['step_s']:.4f} | {x} | {r['tokens_per_s']:.0f} | "
                     f"{r['tflops']:.1f} | {peak} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny GPT on the CPU, one warm-up and two timed steps")
    ap.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=None, help="run only these")
    ap.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=None, help="run only these model sizes")
    ap.add_argument("--budget-s", type=float, default=330.0, help="start no run after this many seconds")
    ap.add_argument("--timeout-s", type=float, default=150.0, help="one run's limit")
    ap.add_argument("--results", default=None, help="Markdown report (default bench/results/gpu_bench-<device>.md)")
    ap.add_argument("--child", choices=STRATEGIES, help=argparse.SUPPRESS)
    ap.add_argument("--size", choices=sorted(SIZES), help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--tiny-steps", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        Path(args.json).write_text(json.dumps(run_one(args.child, args.size, args.tiny_steps)))
        return 0
    plan = [("tiny", s) for s in STRATEGIES] if args.tiny else PLAN
    plan = [(size, s) for size, s in plan if (args.strategies is None or s in args.strategies)
            and (args.sizes is None or size in args.sizes) and available(s)]
    start, rows = time.monotonic(), []
    for size, strategy in plan:
        if time.monotonic() - start > args.budget_s:
            rows.append({"strategy": strategy, "size": size, "error": "not run: --budget-s spent"})
            continue
        print(f"gpu bench: {size} {strategy}", flush=True)
        rows.append(run_child(strategy, size, args.tiny, args.timeout_s))
        print("  " + (rows[-1].get("error") or f"{rows[-1]['step_s']:.4f} s/step"), flush=True)
    device = next((r["device"] for r in rows if "device" in r), "unknown device")
    slug = "".join(c if c.isalnum() else "-" for c in device).strip("-").lower() or "device"
    results = Path(args.results or ROOT / "bench" / "results" / f"gpu_bench-{'tiny-' if args.tiny else ''}{slug}.md")
    cmd = "python -m bench.gpu_bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    torch_version = next((r["torch"] for r in rows if "torch" in r), "?")
    text = (f"# GPU benchmark (issue 32)\n\nCommand: `{cmd}`; device: {device}; torch {torch_version}; "
            f"{time.monotonic() - start:.0f} s in all.\n\nbf16, AdamW lr {LR}, world 1, median of "
            f"{2 if args.tiny else TIMED_STEPS} steps after {1 if args.tiny else WARMUP_STEPS} warm-up; peak = "
            f"max_memory_allocated over the timed steps.\n\n{table(rows)}\n")
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(text)
    results.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(text)
    return 0 if any("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
