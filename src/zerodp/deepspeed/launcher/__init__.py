"""`deepspeed.launcher`: what launchers read from DeepSpeed's (runner.py); DeepSpeed's own `deepspeed` command
is not provided (torchrun starts the ranks)."""
