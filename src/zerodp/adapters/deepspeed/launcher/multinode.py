"""The command lines of a DeepSpeed-style launch, composed of existing launchers (no transport of zerodp's own).

One host (no hostfile, or a filter that leaves one host, and no `--force_multi`): torchrun on this machine.
Several hosts: one process per host, started by the cluster's own tool, runs `zerodp.deepspeed.launcher.launch`
(launch.py), which becomes torchrun for that host's slots:

- pdsh (the default): `pdsh -S -f 1024 -w H1,H2 'export ...; cd CWD; python -u -m zerodp.deepspeed.launcher.launch
  --node_rank=%n ...'` over ssh; the node's index is pdsh's `%n` (its position in -w: the hostfile's order).
- openmpi: `mpirun -n H --host H1,H2 --map-by ppr:1:node -x K=V ... python -u -m ...launch
  --node_rank_env=OMPI_COMM_WORLD_RANK ...`.
- mpich: `mpirun -n H -ppn 1 -hosts H1,H2 -genv K V ... python -u -m ...launch --node_rank_env=PMI_RANK ...`.
- slurm: `srun -n H --ntasks-per-node=1 --nodes=H [--nodelist=...] --export=ALL,K=V,... python -u -m ...launch
  --c10d=ID ...`: no node index (srun chooses the placement), c10d rendezvous at MASTER_ADDR:MASTER_PORT.

What every node gets (`exports`): ZERODP_DEEPSPEED_ALIAS=1 (the alias), PYTHONPATH with the launching directory
first (as DeepSpeed does), the launching shell's variables whose names start with one of DeepSpeed's prefixes
(MLFLOW, PYTHON, MV2, UCX) or NCCL or ZERODP, and the `NAME=VALUE` lines of DeepSpeed's `.deepspeed_env` files
(`~/.deepspeed_env`, then `./.deepspeed_env`; the name is DS_ENV_FILE if set), which win over the shell's.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from _zerodp_deepspeed_alias import ENV as ALIAS_ENV

from .hostfile import LauncherError
from .launch import c10d_rendezvous, encode_world_info, rank_env, static_rendezvous, torchrun_command

LAUNCHERS = ("pdsh", "openmpi", "mpich", "slurm")
EXPORT_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL", "ZERODP")  # DeepSpeed's, its CUDA one, and zerodp's
PDSH_FANOUT = 1024  # hosts pdsh contacts at once (DeepSpeed's PDSH_MAX_FAN_OUT)


@dataclass
class LaunchPlan:
    """Everything a launch's command lines are made of (the runner fills it from its options)."""

    active: "OrderedDict[str, list[int]]"  # host -> slot ids, in node order
    master_addr: str
    master_port: int
    script: str
    script_args: list[str] = field(default_factory=list)
    module: bool = False
    local_rank: bool = True                 # pass --local_rank=K to the script (DeepSpeed's default)
    exports: "OrderedDict[str, str]" = field(default_factory=OrderedDict)
    launcher_args: list[str] = field(default_factory=list)
    ssh_port: Optional[int] = None
    venv_script: Optional[str] = None
    num_gpus: int = -1
    narrowed: bool = False                  # --include/--exclude/--num_nodes chose the hosts (srun: --nodelist)
    run_id: str = "zerodp-deepspeed"
    cwd: str = field(default_factory=os.getcwd)
    python: str = sys.executable


def read_env_file(path: Path) -> "OrderedDict[str, str]":
    """A `.deepspeed_env` file: `NAME=VALUE` a line (blank lines and `#` comments skipped)."""
    found: OrderedDict[str, str] = OrderedDict()
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep or not name.strip():
            raise LauncherError(f"{path}:{number}: {line!r} is not NAME=VALUE")
        found[name.strip()] = value.strip()
    return found


def exports(env: dict, env_files: list[Path], cwd: str) -> "OrderedDict[str, str]":
    """The variables every node gets (see the module docstring), in a stable order."""
    out: OrderedDict[str, str] = OrderedDict()
    for name in sorted(env):
        if name.startswith(EXPORT_PREFIXES):
            out[name] = env[name]
    out["PYTHONPATH"] = cwd + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out[ALIAS_ENV] = "1"
    for path in env_files:
        if path.is_file():
            out.update(read_env_file(path))
    return out


def deepspeed_env_files(env: dict) -> list[Path]:
    """Where DeepSpeed's launcher looks for its environment file: the home directory, then the working one."""
    name = env.get("DS_ENV_FILE", ".deepspeed_env")
    return [Path(os.path.expanduser("~")) / name, Path(".") / name]


def node_launch(plan: LaunchPlan, where: list[str]) -> list[str]:
    """The per-host process (launch.py) that becomes torchrun; `where` says how it finds its node."""
    world_info = f"--world_info={encode_world_info(plan.active)}"
    return [plan.python, "-u", "-m", "zerodp.deepspeed.launcher.launch", world_info, *where,
            f"--master_addr={plan.master_addr}", f"--master_port={plan.master_port}",
            *(["--module"] if plan.module else []), *([] if plan.local_rank else ["--no_local_rank"]),
            plan.script, *plan.script_args]


def local_command(plan: LaunchPlan, env: dict) -> tuple[list[str], dict]:
    """One host, this machine: torchrun here (no ssh), with the host's slots as its devices."""
    (host, slots), = plan.active.items()
    command = torchrun_command(1, len(slots), static_rendezvous(0, plan.master_addr, plan.master_port), plan.script,
                               plan.script_args, module=plan.module, local_rank=plan.local_rank)
    return command, rank_env(slots, env)


def no_ssh_command(plan: LaunchPlan, node_rank: int, env: dict) -> tuple[list[str], dict]:
    """`--no_ssh --node_rank N`: the user starts the runner on every host; this host runs its node's torchrun."""
    command = node_launch(plan, [f"--node_rank={node_rank}"])
    return command, {**env, **plan.exports}


def pdsh_command(plan: LaunchPlan, env: dict) -> tuple[list[str], dict]:
    env = dict(env, PDSH_RCMD_TYPE="ssh")
    if plan.ssh_port is not None:
        env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {plan.ssh_port}".strip()
    remote = [f"export {name}={shlex.quote(value)};" for name, value in plan.exports.items()]
    if plan.venv_script:
        remote.append(f"source {shlex.quote(plan.venv_script)};")
    remote.append(f"cd {shlex.quote(plan.cwd)};")
    # pdsh replaces %n by the host's position in the -w list: the node rank (shlex leaves % unquoted)
    remote += [shlex.quote(part) for part in node_launch(plan, ["--node_rank=%n"])]
    return ["pdsh", "-S", "-f", str(PDSH_FANOUT), "-w", ",".join(plan.active), *plan.launcher_args,
            " ".join(remote)], env


def openmpi_command(plan: LaunchPlan, env: dict) -> tuple[list[str], dict]:
    hosts = list(plan.active)
    exported = [arg for name, value in plan.exports.items() for arg in ("-x", f"{name}={value}")]
    return ["mpirun", "-n", str(len(hosts)), "--host", ",".join(hosts), "--map-by", "ppr:1:node",
            *plan.launcher_args, *exported, *node_launch(plan, ["--node_rank_env=OMPI_COMM_WORLD_RANK"])], env


def mpich_command(plan: LaunchPlan, env: dict) -> tuple[list[str], dict]:
    hosts = list(plan.active)
    exported = [arg for name, value in plan.exports.items() for arg in ("-genv", name, value)]
    return ["mpirun", "-n", str(len(hosts)), "-ppn", "1", "-hosts", ",".join(hosts), *plan.launcher_args, *exported,
            *node_launch(plan, ["--node_rank_env=PMI_RANK"])], env


def slurm_command(plan: LaunchPlan, env: dict) -> tuple[list[str], dict]:
    if len({tuple(slots) for slots in plan.active.values()}) != 1:
        raise LauncherError(f"--launcher slurm runs the same slots on every host (srun chooses where each task "
                            f"runs), got {dict(plan.active)}; filter whole hosts, or use --launcher pdsh")
    bad = [name for name, value in plan.exports.items() if "," in value]
    if bad:
        raise LauncherError(f"--launcher slurm passes variables as srun --export=ALL,NAME=VALUE,...; {bad[0]}'s value "
                            f"contains a comma; set it in the job's environment instead")
    hosts = list(plan.active)
    command = ["srun", "-n", str(len(hosts)), "--ntasks-per-node=1", f"--nodes={len(hosts)}"]
    if plan.narrowed:
        command.append(f"--nodelist={','.join(hosts)}")
    if plan.num_gpus > 0:
        command.append(f"--gpus-per-node={plan.num_gpus}")
    export = ",".join(["--export=ALL", *(f"{name}={value}" for name, value in plan.exports.items())])
    return [*command, *plan.launcher_args, export, *node_launch(plan, [f"--c10d={plan.run_id}"])], env


COMPOSERS = {"pdsh": pdsh_command, "openmpi": openmpi_command, "mpich": mpich_command, "slurm": slurm_command}
# the program each launcher needs on PATH
PROGRAMS = {"pdsh": "pdsh", "openmpi": "mpirun", "mpich": "mpirun", "slurm": "srun"}


def multinode_command(launcher: str, plan: LaunchPlan, env: dict) -> tuple[list[str], dict]:
    """The command (and its environment) that starts one torchrun per host through `launcher`."""
    if launcher not in COMPOSERS:
        raise LauncherError(f"--launcher {launcher!r} is not supported; choose one of {', '.join(LAUNCHERS)} "
                            f"(each starts torchrun on every host)")
    return COMPOSERS[launcher](plan, env)


__all__ = ["LAUNCHERS", "LaunchPlan", "c10d_rendezvous", "deepspeed_env_files", "exports", "local_command",
           "multinode_command", "no_ssh_command", "read_env_file"]
