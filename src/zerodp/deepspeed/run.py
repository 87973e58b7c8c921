"""`python -m zerodp.deepspeed.run script.py ARGS`: run an unchanged DeepSpeed script on zerodp.

    torchrun --nproc_per_node 2 -m zerodp.deepspeed.run train.py --deepspeed_config ds.json

installs the `deepspeed` alias (alias.py), then runs the script as `__main__` with its own directory first
on sys.path and `sys.argv` = [script, ARGS...], as `python script.py ARGS` would.
"""

from __future__ import annotations

import os
import runpy
import sys

from .alias import install


def main(argv: list[str]) -> None:
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m zerodp.deepspeed.run SCRIPT.py [script arguments...]")
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"zerodp.deepspeed.run: no such script: {script}")
    install()
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # was this package's directory under -m
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
