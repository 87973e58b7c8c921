"""Two simulated nodes under torchrun's c10d rendezvous, a kill -9 of one worker mid-run, and an elastic
restart (issue 41, part 3): the harness of tests/e2e/test_elastic_nodes.py, also runnable many times in a row:

    PYTHONPATH=src OMP_NUM_THREADS=1 python tests/e2e/elastic_nodes.py --runs 5 [--script]

Each node is one `torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint localhost:PORT
--max_restarts 1` agent on this machine; both run `zerodp train` (or, with --script, the README's own-script
restart pattern, tests/e2e/elastic_script.py) with a checkpoint every step. Once the run is past its second
checkpoint, one worker of the second node is killed with SIGKILL. Prints one line per run and exits 1 if any
run failed or ended with other parameters than the uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import psutil

HERE = Path(__file__).resolve().parent
# 4 ranks of the tiny GPT at stage 2, a checkpoint every step: small enough for 2 shared cores
STEPS = 8
TRAIN = ["--model", "tiny", "--micro-batch", "2", "--seq-len", "16", "--log-every", "1", "--stage", "2",
         "--steps", str(STEPS), "--save-every", "1"]
SCRIPT = HERE / "elastic_script.py"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(port: int, out: Path, script: bool, nproc_per_node: int = 2, max_restarts: int = 1) -> list[str]:
    """One node's torchrun agent (the set-up docs/cli.md shows, with the rendezvous on localhost)."""
    job = [str(SCRIPT), str(out), str(STEPS)] if script else ["-m", "zerodp", "train", *TRAIN, "--out", str(out)]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", str(nproc_per_node),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"localhost:{port}", "--rdzv_id", f"elastic-{port}",
            "--max_restarts", str(max_restarts), "--monitor_interval", "0.2", *job]


def checkpoints_done(out: Path, script: bool) -> int:
    """Steps whose checkpoint is complete (the `latest` file names the newest)."""
    latest = out / ("ckpt" if script else "checkpoints") / "latest"
    try:
        return int(latest.read_text().strip().removeprefix("global_step"))
    except (FileNotFoundError, ValueError):
        return 0


def workers(agent: subprocess.Popen) -> list[psutil.Process]:
    """The worker processes one torchrun agent started (its direct children that run python)."""
    return [p for p in psutil.Process(agent.pid).children() if "python" in p.name().lower()]


class NodesRun(NamedTuple):
    results: list[tuple[int, str, str]]  # (exit code, stdout, stderr) per agent
    killed_at: int | None                # the newest complete checkpoint's step when the worker was killed

    @property
    def codes(self) -> list[int]:
        return [code for code, _, _ in self.results]

    @property
    def stdout(self) -> str:
        return "".join(stdout for _, stdout, _ in self.results)


def run_nodes(out: Path, script: bool, kill_after: int | None, timeout_s: float = 240) -> NodesRun:
    """Start the two agents; with `kill_after`, SIGKILL one worker of the second node once that many steps
    are checkpointed."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    logs = [tempfile.TemporaryFile("w+") for _ in range(4)]
    agents = [subprocess.Popen(agent_command(port, out, script), stdout=logs[2 * i], stderr=logs[2 * i + 1],
                               text=True, env=env) for i in range(2)]
    deadline = time.monotonic() + timeout_s
    killed_at = None
    try:
        if kill_after is not None:
            while checkpoints_done(out, script) < kill_after:
                if any(a.poll() is not None for a in agents) or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            else:
                victims = workers(agents[1])
                if victims:
                    killed_at = checkpoints_done(out, script)
                    os.kill(victims[-1].pid, signal.SIGKILL)  # a real kill -9, mid-training
        for agent in agents:
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for agent in agents:
            if agent.poll() is None:
                for child in psutil.Process(agent.pid).children(recursive=True):
                    child.kill()
                agent.kill()
                agent.wait()
    results = []
    for i, agent in enumerate(agents):
        texts = []
        for log in logs[2 * i:2 * i + 2]:
            log.seek(0)
            texts.append(log.read())
            log.close()
        results.append((agent.returncode, texts[0], texts[1]))
    return NodesRun(results, killed_at)


def final_params(out: Path, script: bool) -> dict:
    import zerodp

    return zerodp.consolidate_checkpoint(out / ("ckpt" if script else "checkpoints"))


def equal_params(a: dict, b: dict) -> list[str]:
    """The names whose tensors differ (bitwise), or that only one side has."""
    import torch

    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--script", action="store_true", help="the README's own-script pattern, not zerodp train")
    ns = parser.parse_args(argv)
    failed = 0
    with tempfile.TemporaryDirectory() as d:
        reference = Path(d) / "reference"
        codes = run_nodes(reference, ns.script, kill_after=None).codes
        if codes != [0, 0]:
            print(f"the uninterrupted run failed: {codes}")
            return 1
        expected = final_params(reference, ns.script)
        for i in range(ns.runs):
            out = Path(d) / f"killed{i}"
            t0 = time.monotonic()
            run = run_nodes(out, ns.script, kill_after=2)
            codes = run.codes
            differ = equal_params(expected, final_params(out, ns.script)) if codes == [0, 0] else ["(not run)"]
            ok = codes == [0, 0] and not differ and run.killed_at is not None and run.killed_at < STEPS
            failed += not ok
            print(f"run {i + 1}: killed after step {run.killed_at}, exit codes {codes}, "
                  f"{'bitwise equal' if not differ else f'differ: {differ[:3]}'}, {time.monotonic() - t0:.0f} s",
                  flush=True)
            if not ok:
                for code, stdout, stderr in run.results:
                    print(f"--- exit {code}\n{stdout[-1500:]}\n{stderr[-3000:]}")
    print(f"{ns.runs - failed}/{ns.runs} elastic two-node runs ended bitwise equal")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
