"""`deepspeed.launcher.runner`: DeepSpeed's `deepspeed` command, composed of torchrun and the cluster's launcher.

    zerodp-deepspeed [--hostfile H] [--include S | --exclude S | --num_nodes N --num_gpus G] [--master_addr A]
                     [--master_port P] [--launcher pdsh|openmpi|mpich|slurm] [--launcher_args "..."]
                     [--module] [--no_local_rank] [--force_multi] [--no_ssh --node_rank N] train.py ARGS

(also `python -m zerodp.deepspeed.launcher.runner ...`, and DeepSpeed's own `deepspeed` command under
ZERODP_DEEPSPEED_ALIAS=1, whose `from deepspeed.launcher.runner import main` is this `main`). The hostfile and the
filters mean what they mean in DeepSpeed (hostfile.py). One host: torchrun here, one rank per slot. Several
hosts: one torchrun per host, started through pdsh/ssh, mpirun or srun (multinode.py), carrying the alias and
DeepSpeed's `.deepspeed_env`. Every rank runs the script through `zerodp.deepspeed.run`, so `import deepspeed` is
zerodp.deepspeed, and gets `--local_rank=K` first unless `--no_local_rank` (DeepSpeed's convention).

Where it differs from DeepSpeed's: with several hosts and no `--master_addr`, the first host's name as the
hostfile writes it is the master address (DeepSpeed asks that host for its IP over ssh); ranks are numbered by
torchrun (node by node in the hostfile's order, or in c10d's join order under slurm); without a hostfile and
without a GPU, `--num_gpus N` runs N ranks on the CPU. DeepSpeed options zerodp does not provide (autotuning, core
binding, per-rank logs, impi/mvapich) are refused by name, never ignored.

`DEEPSPEED_ENVIRONMENT_NAME` and `DEEPSPEED_ENVIRONMENT_PATHS` keep DeepSpeed's meaning: `accelerate launch
--use_deepspeed` imports them (accelerate 1.15 `commands/launch.py`) to append its environment to the file that
the multi-node launch exports on every node.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Optional

from .hostfile import LauncherError, active_resources, parse_hostfile
from .multinode import (LAUNCHERS, PROGRAMS, LaunchPlan, deepspeed_env_files, exports, local_command,
                        multinode_command, no_ssh_command)

# the file of environment variables DeepSpeed's multi-node launcher exports on every node
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
# where DeepSpeed's launcher looks for that file: the home directory, then the working directory
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's default (DLTS); its absence means: this machine only
DEFAULT_MASTER_PORT = 29500          # torch.distributed's (DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT)
# DeepSpeed options that zerodp's launcher does not provide: refused by name
UNSUPPORTED = {"autotuning": "autotuning", "bind_cores_to_rank": "core binding", "bind_core_list": "core binding",
               "enable_each_rank_log": "per-rank log files (torchrun's --log-dir does this)",
               "save_pid": "the pid file", "no_python": "non-Python programs (the ranks run zerodp.deepspeed.run)"}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="zerodp-deepspeed", description="DeepSpeed's launcher on zerodp: torchrun on "
                                "each host, started through pdsh/ssh, mpirun or srun")
    p.add_argument("-H", "--hostfile", default=None, help=f"MPI-style hostfile, `NAME slots=N` a line (default "
                   f"{DEFAULT_HOSTFILE} if it exists; without one, this machine only)")
    p.add_argument("-i", "--include", default="", help="NAME[:SLOT[,SLOT...]][@NAME...]: the hosts/slots to use")
    p.add_argument("-e", "--exclude", default="", help="the same syntax: the hosts/slots to leave out")
    p.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1, help="ranks per host (slots 0..G-1)")
    p.add_argument("--master_port", type=int, default=DEFAULT_MASTER_PORT)
    p.add_argument("--master_addr", default="", help="address of the first host (default: its hostfile name; "
                   "127.0.0.1 on one machine)")
    p.add_argument("--node_rank", type=int, default=-1, help="this host's index (with --no_ssh)")
    p.add_argument("--launcher", default="pdsh", help=f"how to reach the hosts: {', '.join(LAUNCHERS)}")
    p.add_argument("--launcher_args", default="", help="extra arguments for pdsh/mpirun/srun, one quoted string")
    p.add_argument("--module", action="store_true", help="the script is a module name (python -m)")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=K to the script")
    p.add_argument("--no_ssh", action="store_true", help="start this host's part only (run it on every host with "
                   "its --node_rank)")
    p.add_argument("--no_ssh_check", action="store_true", help="skip the passwordless-ssh check of pdsh")
    p.add_argument("--force_multi", action="store_true", help="the multi-host path even for one host")
    p.add_argument("--ssh_port", type=int, default=None)
    p.add_argument("--venv_script", default=None, help="a script each host sources first (pdsh)")
    p.add_argument("--log_level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("--autotuning", default="", help=argparse.SUPPRESS)
    p.add_argument("--bind_cores_to_rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bind_core_list", default=None, help=argparse.SUPPRESS)
    p.add_argument("--enable_each_rank_log", default=None, help=argparse.SUPPRESS)
    p.add_argument("--save_pid", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no_python", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("user_script", help="the training script (or module, with --module)")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def _refuse_unsupported(ns: argparse.Namespace) -> None:
    for name, what in UNSUPPORTED.items():
        if getattr(ns, name):
            raise LauncherError(f"--{name}: zerodp's launcher does not provide {what}; drop the option")
    if ns.launcher.lower() not in LAUNCHERS:
        raise LauncherError(f"--launcher {ns.launcher!r} is not supported; choose one of {', '.join(LAUNCHERS)} "
                            f"(each starts torchrun on every host)")
    for name in ("ssh_port", "venv_script"):
        if getattr(ns, name) is not None and ns.launcher.lower() != "pdsh":
            raise LauncherError(f"--{name} is for --launcher pdsh (ssh); with {ns.launcher} drop it, or set it up "
                                f"in the launcher's own way (--launcher_args)")


def _pool(ns: argparse.Namespace, env: dict) -> tuple[dict, bool]:
    """The resource pool and whether it came from a hostfile (else: this machine)."""
    path = ns.hostfile or DEFAULT_HOSTFILE
    if os.path.isfile(path):
        return parse_hostfile(Path(path).read_text(), path), True
    if ns.hostfile is not None:
        raise LauncherError(f"--hostfile {ns.hostfile}: no such file; write one host a line as `NAME slots=N`, or "
                            f"leave --hostfile out to run on this machine only")
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    if visible and not (ns.include or ns.exclude or ns.num_nodes > 0 or ns.num_gpus > 0):
        ns.include = f"localhost:{visible}"  # DeepSpeed's reading of CUDA_VISIBLE_DEVICES on one machine
    import torch  # here, not at import: the alias imports this module in every process

    gpus = torch.cuda.device_count()
    if gpus == 0 and ns.num_gpus <= 0:
        raise LauncherError("no hostfile and no GPU on this machine: pass --num_gpus N to run N ranks on the CPU, "
                            "or a hostfile with the line `localhost slots=N`")
    return {"localhost": max(gpus, ns.num_gpus, *(int(s) + 1 for s in visible.split(",") if s.isdigit()))}, False


def plan_launch(ns: argparse.Namespace, env: dict) -> tuple[list[str], dict]:
    """The command (and environment) this launch runs: torchrun here, or the launcher that starts it per host."""
    _refuse_unsupported(ns)
    if ns.no_ssh and ns.node_rank < 0:
        raise LauncherError("--no_ssh starts only this host's part: give its --node_rank (0 for the hostfile's first "
                            "host, ...), and run the same command on every host")
    pool, from_hostfile = _pool(ns, env)
    active = active_resources(pool, ns.include, ns.exclude, ns.num_nodes, ns.num_gpus)
    multi = (ns.force_multi or len(active) > 1) and not ns.no_ssh
    if not from_hostfile and (multi or ns.no_ssh):
        raise LauncherError("several hosts need a hostfile (--hostfile H, `NAME slots=N` a line)")
    if ns.no_ssh and not 0 <= ns.node_rank < len(active):
        raise LauncherError(f"--node_rank {ns.node_rank} is outside the {len(active)} host(s) {', '.join(active)}")
    master_addr = ns.master_addr or (next(iter(active)) if (multi or ns.no_ssh) else "127.0.0.1")
    plan = LaunchPlan(active=active, master_addr=master_addr, master_port=ns.master_port, script=ns.user_script,
                      script_args=list(ns.user_args), module=ns.module, local_rank=not ns.no_local_rank,
                      launcher_args=shlex.split(ns.launcher_args), ssh_port=ns.ssh_port,
                      venv_script=ns.venv_script, num_gpus=ns.num_gpus,
                      narrowed=bool(ns.include or ns.exclude or ns.num_nodes > 0),
                      run_id=f"zerodp-deepspeed-{uuid.uuid4().hex[:8]}")
    if ns.no_ssh:
        plan.exports = exports(env, deepspeed_env_files(env), plan.cwd)
        return no_ssh_command(plan, ns.node_rank, env)
    if not multi:
        if plan.launcher_args:
            print(f"zerodp-deepspeed: warning: one host, so torchrun runs here and --launcher_args "
                  f"{ns.launcher_args!r} is not used (--force_multi goes through --launcher {ns.launcher})",
                  file=sys.stderr)
        return local_command(plan, env)
    launcher = ns.launcher.lower()
    plan.exports = exports(env, deepspeed_env_files(env), plan.cwd)
    return multinode_command(launcher, plan, env)


def _check_reachable(ns: argparse.Namespace, command: list[str], env: dict) -> None:
    """The cluster tool is on PATH, and (pdsh) the first host answers passwordless ssh, before anything starts."""
    program = command[0]
    if program == sys.executable:
        return
    if shutil.which(program, path=env.get("PATH")) is None:
        raise LauncherError(f"--launcher {ns.launcher} needs `{program}` on PATH, and it is not there; install it or "
                            f"choose another --launcher ({', '.join(f'{k}: {v}' for k, v in PROGRAMS.items())})")
    if program == "pdsh" and not ns.no_ssh_check:
        host = command[command.index("-w") + 1].split(",")[0]
        probe = ["ssh", "-o", "PasswordAuthentication=no", *(["-p", str(ns.ssh_port)] if ns.ssh_port else []), host,
                 "hostname"]
        if subprocess.run(probe, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env).returncode != 0:
            raise LauncherError(f"host {host} is not reachable by passwordless ssh ({' '.join(probe)} failed); set up "
                                f"ssh keys, or pass --no_ssh_check to try anyway")


def main(args: Optional[list[str]] = None) -> None:
    """DeepSpeed's `deepspeed` command: start the ranks; exit with the launch's exit code."""
    ns = parse_args(args)
    env = dict(os.environ)
    try:
        command, env = plan_launch(ns, env)
        _check_reachable(ns, command, env)
    except LauncherError as err:
        raise SystemExit(f"zerodp-deepspeed: error: {err}") from None
    if not ns.quiet and ns.log_level in ("debug", "info"):
        print(f"zerodp-deepspeed: {' '.join(command)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(command, env=env)

    def forward(signum, frame):  # Ctrl-C / a scheduler's SIGTERM reach the launch, which stops its ranks
        proc.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    code = proc.wait()
    if code:
        sys.exit(code if code > 0 else 128 - code)


if __name__ == "__main__":
    main()
