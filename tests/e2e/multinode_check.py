"""Launch the two-node job of tests/e2e/test_multinode.py (two torchrun agents, `--nnodes 2`, c10d on
localhost, 1 rank each, stage 3, 4 steps) many times in a row; every run must exit 0 on both agents.

Issue 19: an abort at exit ("terminate called without an active exception") made one such run in 8
fail before engine.close() released stage 3's reduction communicator. Not part of the suite (each
run costs ~10 s on 2 cores):

    PYTHONPATH=src OMP_NUM_THREADS=1 python tests/e2e/multinode_check.py --runs 50

Prints one line per failed run and a final "N/N two-node runs exited 0"; exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile

# the job of tests/e2e/test_multinode.py too
TINY = ["--model", "tiny", "--micro-batch", "2", "--seq-len", "16", "--log-every", "2", "--stage", "3",
        "--save-every", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes_once(out: str, steps: int = 4) -> list[tuple[int, str]]:
    """One two-node run; returns (exit code, stderr tail) per agent."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--rdzv_backend", "c10d", "--rdzv_endpoint", f"localhost:{port}", "--rdzv_id",
                               f"zerodp-check-{port}", "--max_restarts", "0", "-m", "zerodp", "train", *TINY,
                               "--steps", str(steps), "--out", out],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    results = []
    for node in nodes:
        _, stderr = node.communicate(timeout=300)
        results.append((node.returncode, " | ".join(stderr.strip().splitlines()[-3:])))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    ns = parser.parse_args(argv)
    failed = 0
    for i in range(ns.runs):
        with tempfile.TemporaryDirectory() as d:
            results = two_nodes_once(os.path.join(d, "run"))
        if any(code != 0 for code, _ in results):
            failed += 1
            print(f"run {i + 1}: exit codes {[c for c, _ in results]}: {results}", flush=True)
    print(f"{ns.runs - failed}/{ns.runs} two-node runs exited 0 (torchrun --nnodes 2, stage 3)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
