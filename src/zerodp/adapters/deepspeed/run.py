"""`python -m zerodp.deepspeed.run script.py ARGS`: run an unchanged DeepSpeed script on zerodp.

    torchrun --nproc_per_node 2 -m zerodp.deepspeed.run train.py --deepspeed_config ds.json

installs the `deepspeed` alias (alias.py), then runs the script as `__main__` with its own directory first
on sys.path and `sys.argv` = [script, ARGS...], as `python script.py ARGS` would.

    torchrun --nproc_per_node 2 -m zerodp.deepspeed.run --local_rank train.py ARGS

also passes `--local_rank=<LOCAL_RANK>` first, as DeepSpeed's launcher (`deepspeed train.py`) does: some
scripts (DeepSpeed-Chat's) take their rank only from that argument and never read the environment.
`--module` (after `--local_rank`, if any) runs a module instead, as `python -m MODULE` (DeepSpeed's `--module`).

It also sets ZERODP_DEEPSPEED_ALIAS=1, so every process the script starts (Lightning starts its other ranks
as `[sys.executable, script.py, ...]`) gets the alias at start-up too (src/_zerodp_deepspeed_alias.py).
"""

from __future__ import annotations

import os
import runpy
import sys

from _zerodp_deepspeed_alias import ENV

from ...comm.launch_env import read_launch_environment
from .alias import install


USAGE = "usage: python -m zerodp.deepspeed.run [--local_rank] [--module] SCRIPT.py|MODULE [script arguments...]"


def main(argv: list[str]) -> None:
    local_rank_argument = bool(argv) and argv[0] == "--local_rank"
    if local_rank_argument:
        argv = argv[1:]
        launch = read_launch_environment()  # LaunchError where a launch cannot form one world
        if not launch.distributed and "LOCAL_RANK" not in os.environ:
            raise SystemExit("zerodp.deepspeed.run --local_rank: LOCAL_RANK is not set; launch with torchrun "
                             "(torchrun --nproc_per_node N -m zerodp.deepspeed.run --local_rank SCRIPT.py ...), srun "
                             "or mpirun")
    module = bool(argv) and argv[0] == "--module"  # DeepSpeed's launcher's --module: run it as `python -m` would
    if module:
        argv = argv[1:]
    if not argv or argv[0].startswith("-"):
        raise SystemExit(USAGE)
    target = argv[0]
    if not module and not os.path.isfile(target):
        raise SystemExit(f"zerodp.deepspeed.run: no such script: {target}")
    install()
    os.environ[ENV] = "1"  # inherited by the processes the script starts: their start-up hook installs the alias
    # DeepSpeed's launcher puts --local_rank before the script's own arguments
    sys.argv = [target, f"--local_rank={launch.local_rank}", *argv[1:]] if local_rank_argument else list(argv)
    if module:
        sys.path[0] = os.getcwd()  # as `python -m` has it (was this package's directory under -m)
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.path[0] = os.path.dirname(os.path.abspath(target))  # was this package's directory under -m
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
