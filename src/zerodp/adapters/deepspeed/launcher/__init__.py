"""`deepspeed.launcher`: what launchers read from DeepSpeed's (runner.py); DeepSpeed's own `deepspeed` command
is not provided (torchrun starts the ranks).

Modules:
    runner.py  `deepspeed.launcher.runner`: the names other launchers read from DeepSpeed's launcher.
"""
