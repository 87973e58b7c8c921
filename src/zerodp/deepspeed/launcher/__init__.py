"""`deepspeed.launcher`: DeepSpeed's `deepspeed` command, composed of torchrun and the cluster's launcher.

runner.py is the command (`zerodp-deepspeed`, or DeepSpeed's own `deepspeed` under ZERODP_DEEPSPEED_ALIAS=1),
hostfile.py the hostfile and its filters, multinode.py the command lines per launcher (pdsh, openmpi, mpich,
slurm), launch.py one host's half, which becomes torchrun. docs/multinode_elastic.md describes the use.
"""
