"""`deepspeed.launcher.launch`: one node's half of DeepSpeed's launcher, which starts torchrun on this node.

The runner (runner.py) starts this once on every node, through pdsh, mpirun or srun:

    python -u -m zerodp.deepspeed.launcher.launch --world_info=B64 --node_rank=N|--node_rank_env=VAR|--c10d
        --master_addr=A --master_port=P [--module] [--no_local_rank] SCRIPT ARGS

`--world_info` is the active resources (host -> slot ids, hosts in node order) as base64 JSON, DeepSpeed's
encoding. This node's slots are those of its node rank (`--node_rank`, pdsh's `%n`; or read from `--node_rank_env`,
the MPI rank under `mpirun` with one process per host); with `--c10d` (srun, whose placement zerodp does not
choose) every host has the same slots and torch's c10d rendezvous at A:P numbers the nodes. The process then
*becomes* torchrun (exec, no process of zerodp's in between):

    python -u -m torch.distributed.run --nnodes=H --nproc_per_node=len(slots) (--node_rank=N --master_addr=A
        --master_port=P | --rdzv_backend=c10d --rdzv_endpoint=A:P --rdzv_id=ID)
        -m zerodp.deepspeed.run [--local_rank] [--module] SCRIPT ARGS

with CUDA_VISIBLE_DEVICES = this node's slot ids (as DeepSpeed's launch sets it) and ZERODP_DEEPSPEED_ALIAS=1,
so `import deepspeed` in the script and in every process it starts is zerodp.deepspeed. torchrun's variables
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) are what the ranks read.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from collections import OrderedDict
from typing import Optional

from _zerodp_deepspeed_alias import ENV as ALIAS_ENV

from .hostfile import LauncherError


def encode_world_info(active: "OrderedDict[str, list[int]]") -> str:
    """DeepSpeed's encoding of the active resources: urlsafe base64 of their JSON."""
    return base64.urlsafe_b64encode(json.dumps(active).encode()).decode()


def decode_world_info(encoded: str) -> "OrderedDict[str, list[int]]":
    return json.loads(base64.urlsafe_b64decode(encoded.encode()).decode(), object_pairs_hook=OrderedDict)


def torchrun_command(nnodes: int, nproc_per_node: int, rendezvous: list[str], script: str, script_args: list[str],
                     module: bool = False, local_rank: bool = True) -> list[str]:
    """torchrun on one node, running the script under the `deepspeed` alias (zerodp.deepspeed.run)."""
    run = ["-m", "zerodp.deepspeed.run", *(["--local_rank"] if local_rank else []), *(["--module"] if module else [])]
    return [sys.executable, "-u", "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--nproc_per_node={nproc_per_node}", *rendezvous, *run, script, *script_args]


def static_rendezvous(node_rank: int, master_addr: str, master_port: int) -> list[str]:
    """torchrun's static rendezvous: node `node_rank` of the hostfile's order; node 0 serves the store at A:P."""
    return [f"--node_rank={node_rank}", f"--master_addr={master_addr}", f"--master_port={master_port}"]


def c10d_rendezvous(master_addr: str, master_port: int, run_id: str) -> list[str]:
    """torchrun's c10d rendezvous: the agent on the host A serves the store at A:P; nodes get ranks as they join."""
    return ["--rdzv_backend=c10d", f"--rdzv_endpoint={master_addr}:{master_port}", f"--rdzv_id={run_id}"]


def rank_env(slots: list[int], env: Optional[dict] = None) -> dict:
    """The environment torchrun gets on a node: this node's devices and the `deepspeed` alias."""
    env = dict(os.environ if env is None else env)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in slots)  # the node's slots, as DeepSpeed's launch does
    env[ALIAS_ENV] = "1"
    return env


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m zerodp.deepspeed.launcher.launch",
                                description="one node of a DeepSpeed-style launch: starts torchrun on this node")
    p.add_argument("--world_info", required=True, help="base64 JSON of host -> slot ids (the runner writes it)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--node_rank", type=int, help="this node's index in world_info (pdsh: %%n)")
    where.add_argument("--node_rank_env", help="the variable holding this node's index (mpirun: OMPI_COMM_WORLD_RANK)")
    where.add_argument("--c10d", metavar="RUN_ID", help="no node index: c10d rendezvous under this run id (srun)")
    p.add_argument("--master_addr", required=True)
    p.add_argument("--master_port", type=int, required=True)
    p.add_argument("--module", action="store_true", help="SCRIPT is a module name (python -m)")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=K to the script")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def node_command(ns: argparse.Namespace, env: dict) -> tuple[list[str], dict]:
    """The torchrun command and environment of this node (exec'd by main)."""
    world = decode_world_info(ns.world_info)
    hosts = list(world)
    if ns.c10d is not None:
        slot_lists = {tuple(s) for s in world.values()}
        if len(slot_lists) != 1:
            raise LauncherError(f"without a node rank every host must run the same slots, got {dict(world)}")
        slots, rendezvous = list(next(iter(slot_lists))), c10d_rendezvous(ns.master_addr, ns.master_port, ns.c10d)
    else:
        if ns.node_rank is not None:
            node_rank = ns.node_rank
        else:
            value = env.get(ns.node_rank_env)
            if value is None or not value.isdigit():
                raise LauncherError(f"--node_rank_env {ns.node_rank_env}: the variable is {value!r} on this host, "
                                    f"not a node index; was this started by the launcher that sets it?")
            node_rank = int(value)
        if not 0 <= node_rank < len(hosts):
            raise LauncherError(f"node rank {node_rank} is outside the {len(hosts)} host(s) {', '.join(hosts)}")
        slots, rendezvous = world[hosts[node_rank]], static_rendezvous(node_rank, ns.master_addr, ns.master_port)
    command = torchrun_command(len(hosts), len(slots), rendezvous, ns.script, ns.script_args, module=ns.module,
                               local_rank=not ns.no_local_rank)
    return command, rank_env(slots, env)


def main(argv: Optional[list[str]] = None) -> None:
    ns = _parse(sys.argv[1:] if argv is None else argv)
    try:
        command, env = node_command(ns, dict(os.environ))
    except LauncherError as err:
        raise SystemExit(f"zerodp.deepspeed.launcher.launch: error: {err}") from None
    sys.stdout.flush()
    os.execve(command[0], command, env)  # this process becomes torchrun: its exit code is the node's


if __name__ == "__main__":
    main()
