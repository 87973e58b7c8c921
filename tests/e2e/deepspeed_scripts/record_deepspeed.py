"""Record real DeepSpeed's losses for every case in cases.py into expected_deepspeed.json.

    cd tests/e2e/deepspeed_scripts && /work/main/bench/.venv/bin/python record_deepspeed.py [CASE ...]

(with case names: records only those, keeping the other recorded cases of expected_deepspeed.json)

Runs each case under torchrun on 2 gloo ranks with DS_ACCELERATOR=cpu in the bench venv (DeepSpeed 0.19.8),
the shim on PYTHONPATH (synthetic CIFAR10, SEED_AT_START, the loss recorder; it also drops the
"cuda:nccl" entry DeepSpeed's init_distributed hands to this CPU-only torch). Cases whose scripts read
--local_rank (DeepSpeed-Chat) run under DeepSpeed's own launcher instead, as `deepspeed script.py` would.
The DeepSpeed-Chat cases need `datasets` in the bench venv (`pip install datasets`).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import deepspeed
import torch

from cases import CASES, EXPECTED, SEED, TINY_MODEL_KEY, command_args, environment, tiny_model_digest


def main(names: list) -> None:
    meta = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "DS_ACCELERATOR": "cpu",
            "nproc_per_node": 2, "SEED_AT_START": SEED}
    results = json.loads(EXPECTED.read_text()) if names else {}
    if names and results.get("_recorded_with") != meta:
        raise SystemExit(f"{EXPECTED.name} was recorded with {results.get('_recorded_with')}, not {meta}: record all")
    results["_recorded_with"] = meta
    unknown = set(names) - {c.name for c in CASES}
    if unknown:
        raise SystemExit(f"no such cases: {sorted(unknown)}")
    for case in (c for c in CASES if c.reference == "deepspeed" and (not names or c.name in names)):
        with tempfile.TemporaryDirectory() as tmp:
            env = environment(case, dict(os.environ, DS_ACCELERATOR="cpu", SEED_AT_START=str(SEED),
                                         RECORD_ENGINE="deepspeed", RECORD_LOSSES=tmp, OMP_NUM_THREADS="1"),
                              Path(tmp), [])
            if case.local_rank:  # DeepSpeed's own launcher (what `deepspeed script.py` runs): passes --local_rank
                world = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
                launch = ["-m", "deepspeed.launcher.launch", f"--world_info={world}", "--master_addr=127.0.0.1",
                          "--master_port=29731"]
            else:
                launch = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29731"]
            cmd = [sys.executable, *launch, *command_args(case, Path(tmp))]
            proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
            stopped_as_expected = case.expect_error and case.expect_error in proc.stderr
            if (proc.returncode != 0) != bool(stopped_as_expected):
                raise SystemExit(f"{case.name}: DeepSpeed failed\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            digest = tiny_model_digest(case, Path(tmp))
            if digest is not None:
                if results.setdefault(TINY_MODEL_KEY, digest) != digest:
                    raise SystemExit(f"{case.name}: the tiny model's weights differ from those the other DeepSpeed-Chat "
                                     f"cases were recorded with; record all of them")
            results[case.name] = [json.loads((Path(tmp) / f"losses_rank{r}.json").read_text()) for r in range(2)]
            print(case.name, results[case.name], flush=True)
    EXPECTED.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
