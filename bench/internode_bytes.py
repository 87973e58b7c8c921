"""Inter-node bytes per step of every ZeRO mode, measured by the traffic recorder on a real two-node job.

Two torchrun agents on this machine (`--nnodes 2`, 2 ranks each, static rendezvous on localhost), each
given a host name of its own (ZERODP_HOSTNAME: zerodp groups ranks into nodes by host, and torchrun's
LOCAL_WORLD_SIZE / GROUP_RANK agree with it) so zerodp sees the node boundary; the benchmark
GPT (33.7M parameters, fp32, AdamW); for each mode one warm-up step, then two recorded steps. The
recorder (`zerodp.comm.record`) labels each collective inter-node when its group has ranks on both
nodes (comm/topology.py) and counts the ZeRO paper's volume: the buffer's bytes, twice for an
all-reduce. Writes a markdown table (bytes per step and rank, per parameter, and as a fraction of
ZeRO-3's) beside the paper's formulas:

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python bench/internode_bytes.py --out bench/results/internode_bytes.md

About 3 minutes on 2 cores. Not part of the test suite (tests/dist/test_hpz.py checks the same
classification at 4 ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

# mode -> (zero_optimization keys, the paper's volume per step in units of Psi fp32 bytes, inter-node / intra-node)
MODES = {
    "ZeRO-1": ({"stage": 1}, "2 / 0"),
    "ZeRO-2": ({"stage": 2}, "2 / 0"),
    "ZeRO-3": ({"stage": 3}, "3 / 0"),
    "hpZ": ({"stage": 3, "zero_hpz_partition_size": 2}, "2 / 1"),
    "qwZ": ({"stage": 3, "zero_quantized_weights": True}, "2 x 0.254 + 1 = 1.51 / 0"),
    "qgZ": ({"stage": 3, "zero_quantized_gradients": True}, "2 + 0.129 = 2.13 / 0"),
    "ZeRO++ (all three)": ({"stage": 3, "zero_hpz_partition_size": 2, "zero_quantized_weights": True,
                            "zero_quantized_gradients": True}, "0.254 + 0.129 = 0.38 / 1"),
    # blocks of 2 = one node: gathers and reduce-scatters inside; the replicas all-reduce Psi/2 each (volume x2)
    "MiCS / HSDP (2 per block)": ({"stage": 3, "mics_shard_size": 2}, "2 x 1/2 = 1 / 3"),
}
RECORDED_STEPS = 2


def worker(mode: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import zerodp
    from zerodp import comm
    from bench.harness.models import BENCH_MODELS, synthetic_tokens
    from zerodp.tools.models.gpt import GPT, lm_loss

    comm.init_distributed()
    rank = dist.get_rank()
    cfg = BENCH_MODELS["baseline"]
    model = GPT(cfg, seed=0)
    numel = sum(p.numel() for p in model.parameters())
    zero = dict(MODES[mode][0])
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01),
                               {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})

    def step(i: int) -> None:
        ids = synthetic_tokens(i, rank, 1, 32, cfg.vocab_size)  # bytes do not depend on the batch: keep it small
        engine.backward(lm_loss(engine(ids[:, :-1]), ids[:, 1:]))
        engine.step()

    step(0)  # warm-up: the first step records the unit order
    with comm.record() as log:
        for i in range(1, 1 + RECORDED_STEPS):
            step(i)
    by_tag: dict = {}
    for r in log.records:
        key = f"{r.tag or '-'}:{r.op}:{'inter' if r.crosses_nodes else 'intra'}"
        by_tag[key] = by_tag.get(key, 0) + r.volume_bytes // RECORDED_STEPS
    result = {"numel": numel, "inter": log.volume_bytes(True) // RECORDED_STEPS,
              "intra": log.volume_bytes(False) // RECORDED_STEPS, "by_tag": by_tag}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    engine.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(mode: str) -> list[dict]:
    """One two-node job of `mode`; the per-rank results."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as out:
        agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
                                    str(node), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                                    str(port), "--max_restarts", "0", __file__, "--worker", mode, out],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**env, "ZERODP_HOSTNAME": f"node{node}"})
                  for node in range(2)]
        for agent in agents:
            _, err = agent.communicate(timeout=900)
            if agent.returncode != 0:
                raise RuntimeError(f"{mode}: an agent exited {agent.returncode}:\n{err[-3000:]}")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(4)]


def table(results: dict) -> str:
    results = {mode: results[mode] for mode in MODES if mode in results}  # in MODES's order
    base = max(r["inter"] for r in results["ZeRO-3"])
    numel = results["ZeRO-3"][0]["numel"]
    lines = ["| mode | inter-node MiB/step/rank | intra-node MiB/step/rank | inter-node bytes/param | x ZeRO-3 inter "
             "| paper volume, Psi fp32 (inter / intra) |", "|---|---:|---:|---:|---:|---|"]
    for mode, ranks in results.items():
        inter, intra = max(r["inter"] for r in ranks), max(r["intra"] for r in ranks)
        lines.append(f"| {mode} | {inter / 2**20:.1f} | {intra / 2**20:.1f} | {inter / numel:.2f} | "
                     f"{inter / base:.3f} | {MODES[mode][1]} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--modes", nargs="*", default=list(MODES))
    parser.add_argument("--out", default=None, help="write the markdown table (and the per-tag json beside it)")
    parser.add_argument("--merge", action="store_true", help="keep the other modes' results already in --out's json")
    ns = parser.parse_args(argv)
    if ns.worker:
        worker(*ns.worker)
        return 0
    results = {}
    if ns.merge and ns.out and Path(ns.out).with_suffix(".json").exists():
        results = json.loads(Path(ns.out).with_suffix(".json").read_text())
    for mode in ns.modes:
        results[mode] = run_mode(mode)
        print(f"{mode}: inter {results[mode][0]['inter'] / 2**20:.1f} MiB, intra {results[mode][0]['intra'] / 2**20:.1f} "
              f"MiB per step (rank 0)", flush=True)
    text = table(results)
    print(text)
    if ns.out:
        Path(ns.out).write_text(text + "\n")
        Path(ns.out).with_suffix(".json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
