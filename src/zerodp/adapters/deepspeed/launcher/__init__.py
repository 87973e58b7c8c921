"""`deepspeed.launcher`: DeepSpeed's `deepspeed` command, composed of torchrun and the cluster's launcher
(docs/multinode_elastic.md).

Modules:
    runner.py     the command (`zerodp-deepspeed`, or DeepSpeed's own `deepspeed` under ZERODP_DEEPSPEED_ALIAS=1),
                  and the names other launchers read from DeepSpeed's (accelerate: DEEPSPEED_ENVIRONMENT_NAME)
    hostfile.py   the hostfile and what --include/--exclude/--num_nodes/--num_gpus leave of it
    multinode.py  the command lines per launcher (pdsh, openmpi, mpich, slurm) and what every host gets
    launch.py     one host's half, which becomes torchrun for that host's slots
"""
