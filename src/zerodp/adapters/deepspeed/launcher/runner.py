"""`deepspeed.launcher.runner`: the names other launchers read from DeepSpeed's launcher.

`accelerate launch --use_deepspeed` imports DEEPSPEED_ENVIRONMENT_NAME from here (accelerate 1.15
`commands/launch.py`, `deepspeed_launcher`). It means what it means in DeepSpeed: the name of a file of
`NAME=VALUE` lines (`DS_ENV_FILE`, default `.deepspeed_env`) that DeepSpeed's multi-node launcher exports on
every node; accelerate appends its environment to it before running the `deepspeed` command on several
machines (pdsh, openmpi, ...). On one machine accelerate writes nothing there: it starts the ranks with
torch's elastic launcher (torchrun), which is how zerodp's ranks start anyway.

DeepSpeed's `deepspeed` command itself (`main`) is not provided: zerodp has no ssh/pdsh launcher, so
`main()` refuses, naming torchrun and accelerate's `--deepspeed_multinode_launcher standard` (torchrun on
each machine) instead.
"""

from __future__ import annotations

import os

# the file of environment variables DeepSpeed's multi-node launcher exports on every node
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
# where DeepSpeed's launcher looks for that file: the home directory, then the working directory
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]


def main(args=None) -> None:
    """DeepSpeed's `deepspeed` command: refused (zerodp starts ranks with torchrun)."""
    raise SystemExit("zerodp does not provide DeepSpeed's `deepspeed` launcher command; start the ranks with "
                     "torchrun (torchrun --nproc_per_node N -m zerodp.deepspeed.run --local_rank SCRIPT.py ...) or "
                     "`accelerate launch --use_deepspeed` (one machine, or --deepspeed_multinode_launcher standard "
                     "on several) under ZERODP_DEEPSPEED_ALIAS=1 (docs/frameworks.md)")
