"""The launch environment: which launcher started this process, and the one job it belongs to.

Every process of a job learns its place from the environment its launcher set. This module reads it, once,
in one place (`read_launch_environment`), and everything else (process-group creation, `zerodp train`, the
DeepSpeed adapter, the device of a rank) asks it instead of parsing variables itself.

Precedence, first match wins ([Note: one job or a clear stop]):
  1. torchrun's variables (`RANK`, `WORLD_SIZE`; also what torchrun-like launchers set: DeepSpeed's per-node
     launch, Kubernetes' PyTorchJob, a script's own exports). Both or neither: one without the other refuses.
     `LOCAL_RANK` missing: the scheduler's local rank (a script that exported RANK=$SLURM_PROCID), else 0.
  2. Open MPI's `mpirun` (`OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE`).
  3. MPICH / Intel MPI (Hydra's PMI: `PMI_RANK/PMI_SIZE`, `MPI_LOCALRANKID/MPI_LOCALNRANKS`).
  4. SLURM's `srun` (`SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`, `SLURM_LOCALID`, `SLURM_NODEID`, the step's node
     list). MPI's variables come first because `mpirun` inside a SLURM allocation inherits the allocation's
     SLURM variables (its daemons' SLURM_PROCID, not the rank).
  5. PMIx alone (`PMIX_RANK`): a rank but no world size in the environment, so it refuses.
  6. Nothing: one process, world size 1.

A scheduler's world becomes torchrun's variables (`export_torch_variables`), so torch's `env://` rendezvous and
any script that reads `RANK`/`LOCAL_RANK` see the same job:
  MASTER_ADDR  `MASTER_ADDR` if set; else the first host of SLURM's step node list; else 127.0.0.1 when every
               rank runs on one node; else it refuses (MPI gives no address in the environment).
  MASTER_PORT  `MASTER_PORT` if set; else DEFAULT_MASTER_PORT (29500, torchrun's default).

[Note: one job or a clear stop] Before this module, a process started by srun or mpirun without torchrun's
variables saw none of them and trained as a world of one: N copies of one job, each on its own data, writing
the same checkpoints, all exiting 0. Now such a process either joins the one world its launcher made or
refuses before training with `LaunchError`, naming the variables it saw and the fix; never N separate runs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from ..errors import LaunchError

DEFAULT_MASTER_PORT = 29500  # torchrun's (and DeepSpeed's `distributed_port`) default
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_ENV = "ZERODP_LAUNCHER"  # set beside torchrun's variables when they were exported from a scheduler's


@dataclass(frozen=True)
class LaunchEnvironment:
    """This process's place in its job, as its launcher told it."""

    launcher: str                      # "torchrun", "openmpi", "mpich", "slurm" or "none" (one process)
    rank: int                          # global rank
    world_size: int                    # ranks in the job
    local_rank: int                    # rank on this node (picks this rank's GPU)
    local_world_size: Optional[int]    # ranks on this node, as the launcher says (a hint: comm/topology.py checks it)
    node_rank: Optional[int]           # this node's index, as the launcher says (a hint)
    nodes: Optional[int]               # nodes in the job, as the launcher says (a hint)
    master_addr: Optional[str]         # where rank 0's rendezvous store listens
    master_port: Optional[int]
    seen: tuple = ()                   # (name, value) of the launcher variables read, for messages

    @property
    def distributed(self) -> bool:
        """True when this process is one rank of a launched job (torchrun's variables, or a scheduler's world
        of more than one); False for a plain `python train.py`."""
        return self.launcher == "torchrun" or self.world_size > 1

    @property
    def from_scheduler(self) -> bool:
        """The world was formed from a scheduler's variables (torchrun's were absent)."""
        return self.launcher not in ("torchrun", "none")

    def torch_variables(self) -> dict[str, str]:
        """torchrun's variables for this world (what `export_torch_variables` sets)."""
        out = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank)}
        if self.local_world_size is not None:
            out["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        if self.node_rank is not None:
            out["GROUP_RANK"] = str(self.node_rank)
        if self.master_addr is not None:
            out["MASTER_ADDR"] = self.master_addr
        if self.master_port is not None:
            out["MASTER_PORT"] = str(self.master_port)
        return out

    def describe(self) -> str:
        """One line: the launcher and the variables read."""
        return f"{self.launcher} ({', '.join(f'{k}={v}' for k, v in self.seen) or 'no launcher variables'})"


def read_launch_environment(environ: Optional[Mapping[str, str]] = None,
                            default_port: int = DEFAULT_MASTER_PORT) -> LaunchEnvironment:
    """This process's launch environment (see the module docstring for the precedence); raises LaunchError
    where the variables show a launch of several processes but cannot form one world."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        exported = _SCHEDULERS.get(env.get(LAUNCHER_ENV, ""))
        if exported is not None:  # torchrun's variables that export_torch_variables set: report the scheduler's
            found = exported(env, default_port)
            if found is not None and (str(found.rank), str(found.world_size)) == (env["RANK"], env["WORLD_SIZE"]):
                return found
        return _torchrun(env)
    for reader in (_open_mpi, _mpich, _slurm, _pmix):
        found = reader(env, default_port)
        if found is not None:
            return found
    return LaunchEnvironment("none", 0, 1, _int(env, "LOCAL_RANK", 0), None, None, None, None, None)


def export_torch_variables(launch: LaunchEnvironment, environ: Optional[dict] = None) -> None:
    """Set torchrun's variables from a scheduler's world (as DeepSpeed's MPI discovery does), so torch's
    `env://` rendezvous and the user's script see the one job. A no-op for torchrun's own or a single process."""
    if not launch.from_scheduler or not launch.distributed:
        return
    env = os.environ if environ is None else environ
    env.update(launch.torch_variables())
    env[LAUNCHER_ENV] = launch.launcher  # a later reading (the node hints, a child process) names the scheduler


def local_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    """This process's rank on its node (0 for a single process): the one reading of LOCAL_RANK and its
    schedulers' equivalents. Never raises: a broken launch is refused where the world is formed."""
    try:
        return read_launch_environment(environ).local_rank
    except LaunchError:
        return 0


def global_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    """This process's global rank as its launcher says (0 for a single process), before any group exists (the
    watchdog's messages); never raises."""
    try:
        return read_launch_environment(environ).rank
    except LaunchError:
        return 0


# -- torchrun --------------------------------------------------------------------------------------------


def _torchrun(env: Mapping[str, str]) -> LaunchEnvironment:
    # the node hints: torchrun's LOCAL_WORLD_SIZE/GROUP_RANK, or DeepSpeed's per-node launch's LOCAL_SIZE/CROSS_*
    seen = _seen(env, TORCHRUN_VARIABLES + ("LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"))
    if "RANK" not in env or "WORLD_SIZE" not in env:
        missing = "WORLD_SIZE" if "RANK" in env else "RANK"
        raise LaunchError(f"torchrun's variables are incomplete ({_list(seen)}; {missing} is not set), so this "
                          f"process cannot join a job; launch with torchrun, which sets all of them, or set "
                          f"{missing} too (or unset them all for one process)")
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    _check_rank(rank, world, "RANK", "WORLD_SIZE", seen)
    scheduler_local = None
    for reader in (_open_mpi, _mpich, _slurm):  # a LOCAL_RANK left out: the scheduler's, if one started us
        try:
            found = reader(env, DEFAULT_MASTER_PORT)
        except LaunchError:
            found = None
        if found is not None:
            scheduler_local = found.local_rank
            break
    local = _int(env, "LOCAL_RANK", scheduler_local if scheduler_local is not None else 0)
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
    per_node = _opt_int(env, "LOCAL_WORLD_SIZE") or _opt_int(env, "LOCAL_SIZE")
    node = _opt_int(env, "GROUP_RANK") if env.get("GROUP_RANK") else _opt_int(env, "CROSS_RANK")
    nodes = _opt_int(env, "CROSS_SIZE")
    if nodes is None and per_node and world % per_node == 0:
        nodes = world // per_node
    return LaunchEnvironment("torchrun", rank, world, local, per_node, node, nodes, env.get("MASTER_ADDR"), port,
                             seen)


# -- the schedulers ----------------------------------------------------------------------------------------


def _open_mpi(env: Mapping[str, str], default_port: int) -> Optional[LaunchEnvironment]:
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return _mpi_world(env, default_port, "openmpi", names, "mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT")


def _mpich(env: Mapping[str, str], default_port: int) -> Optional[LaunchEnvironment]:
    if "PMI_RANK" not in env:
        return None
    if "SLURM_PROCID" in env and (env.get("PMI_SIZE") is None or (env["PMI_RANK"], env.get("PMI_SIZE")) ==
                                  (env["SLURM_PROCID"], env.get("SLURM_STEP_NUM_TASKS"))):
        return None  # srun's own PMI (the same rank and size): SLURM's variables also say where rank 0 runs
    names = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "MASTER_ADDR", "MASTER_PORT")
    return _mpi_world(env, default_port, "mpich", names,
                      "mpiexec -genv MASTER_ADDR <rank 0's host> -genv MASTER_PORT <port>")


def _mpi_world(env, default_port, launcher: str, names: tuple, fix: str) -> LaunchEnvironment:
    """An MPI launcher's world: rank, size, local rank and size by the names given (in that order)."""
    rank_name, size_name, local_name, local_size_name = names[:4]
    seen = _seen(env, names)
    if size_name not in env:
        raise LaunchError(f"{launcher} started this process ({_list(seen)}) but {size_name} (the world size) is not "
                          f"set; launch with torchrun, or set WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT")
    rank, world = _int(env, rank_name), _int(env, size_name)
    _check_rank(rank, world, rank_name, size_name, seen)
    local, local_size = _int(env, local_name, 0), _opt_int(env, local_size_name)
    addr = env.get("MASTER_ADDR")
    if addr is None and world > 1:
        if local_size == world:
            addr = "127.0.0.1"  # every rank on this node
        else:
            raise LaunchError(f"{launcher} started {world} ranks over several nodes ({_list(seen)}), but the "
                              f"environment does not say where rank 0 runs, so the ranks cannot meet; export it: "
                              f"`{fix}` (or launch with torchrun on each node)")
    nodes = world // local_size if local_size and world % local_size == 0 else None
    return LaunchEnvironment(launcher, rank, world, local, local_size, None, nodes, addr,
                             _port(env, default_port), seen)


def _slurm(env: Mapping[str, str], default_port: int) -> Optional[LaunchEnvironment]:
    if "SLURM_PROCID" not in env:
        return None
    names = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID",
             "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
             "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_LAUNCH_NODE_IPADDR",
             "MASTER_ADDR", "MASTER_PORT")
    seen = _seen(env, names)
    if "SLURM_STEP_NUM_TASKS" not in env:
        # srun sets the step's variables; without them this is the job's batch script (or an salloc shell):
        # one process, whatever SLURM_NTASKS says the allocation could run
        if _int(env, "SLURM_NTASKS", 1) > 1:
            raise LaunchError(f"SLURM variables without a job step ({_list(seen)}; no SLURM_STEP_NUM_TASKS): this is "
                              f"the batch script, one process, not one of the {env['SLURM_NTASKS']} tasks; start the "
                              f"ranks with `srun python train.py ...` (or torchrun on each node); a process that starts "
                              f"its own ranks runs as one task: `srun --ntasks 1 zerodp train --nproc N ...`")
        return LaunchEnvironment("slurm", 0, 1, 0, 1, None, 1, None, None, seen)
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS")
    _check_rank(rank, world, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", seen)
    node = _opt_int(env, "SLURM_NODEID")
    nodes = _opt_int(env, "SLURM_STEP_NUM_NODES") or _opt_int(env, "SLURM_NNODES")
    per_node = None
    counts = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if counts is not None and node is not None:
        expanded = expand_tasks_per_node(counts)
        per_node = expanded[node] if node < len(expanded) else None
    hostlist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    addr = env.get("MASTER_ADDR")
    if addr is None and world > 1:
        if hostlist:
            # rank 0 runs on the step's first node (srun's block and cyclic distributions both start there).
            # Not SLURM_LAUNCH_NODE_IPADDR: that is where srun ran, possibly a login node that runs no rank.
            addr = expand_hostlist(hostlist)[0]
        elif nodes == 1:
            addr = "127.0.0.1"
        else:
            raise LaunchError(f"srun started {world} tasks ({_list(seen)}) but no node list says where rank 0 runs, "
                              f"so the ranks cannot meet; export MASTER_ADDR=<rank 0's host> (and MASTER_PORT) "
                              f"before srun, or launch torchrun on each node")
    return LaunchEnvironment("slurm", rank, world, _int(env, "SLURM_LOCALID", 0), per_node, node, nodes, addr,
                             _port(env, default_port), seen)


def _pmix(env: Mapping[str, str], default_port: int) -> Optional[LaunchEnvironment]:
    if "PMIX_RANK" not in env:
        return None
    seen = _seen(env, ("PMIX_RANK", "PMIX_NAMESPACE", "MASTER_ADDR", "MASTER_PORT"))
    raise LaunchError(f"a PMIx launcher started this process ({_list(seen)}) but its environment does not give the "
                      f"world size; launch with torchrun, srun or Open MPI's mpirun, or set RANK, WORLD_SIZE, "
                      f"LOCAL_RANK, MASTER_ADDR and MASTER_PORT")


_SCHEDULERS = {"openmpi": _open_mpi, "mpich": _mpich, "slurm": _slurm}


# -- SLURM's compact lists -------------------------------------------------------------------------------


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compact host list in full: "node[01-03,07],gpu5" -> node01 node02 node03 node07 gpu5.

    Ranges keep their zero padding; several bracket groups in one name multiply ("r[1-2]n[1-2]": r1n1
    r1n2 r2n1 r2n2)."""
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_one(item))
    if not hosts:
        raise LaunchError(f"SLURM's node list {hostlist!r} names no host; export MASTER_ADDR=<rank 0's host>")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise LaunchError(f"SLURM's node list {text!r} has unbalanced brackets; export MASTER_ADDR=<rank 0's host>")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise LaunchError(f"SLURM's node list {text!r} has unbalanced brackets; export MASTER_ADDR=<rank 0's host>")
    return [item for item in items + [current] if item]


def _expand_one(name: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[:match.start()], name[match.end():]
    values = []
    for part in match.group(1).split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise LaunchError(f"SLURM's node list entry {name!r} has a range {part!r} that is not numbers; "
                              f"export MASTER_ADDR=<rank 0's host>")
        width = len(lo)
        values.extend(f"{i:0{width}d}" for i in range(int(lo), int(hi if sep else lo) + 1))
    return [head + v + rest for v in values for rest in _expand_one(tail)]


def expand_tasks_per_node(counts: str) -> list[int]:
    """SLURM's tasks per node in full, one count per node: "2(x3),1" -> [2, 2, 2, 1]."""
    out: list[int] = []
    for item in counts.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise LaunchError(f"SLURM's tasks per node {counts!r} is not of the form '2(x3),1'")
        out.extend([int(match.group(1))] * int(match.group(2) or 1))
    return out


# -- small readers -----------------------------------------------------------------------------------------


def _seen(env: Mapping[str, str], names) -> tuple:
    return tuple((name, env[name]) for name in names if name in env)


def _list(seen: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in seen)


def _int(env: Mapping[str, str], name: str, default: Optional[int] = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise LaunchError(f"{name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not a whole number; fix the launcher's environment") from None


def _opt_int(env: Mapping[str, str], name: str) -> Optional[int]:
    return _int(env, name) if env.get(name) else None


def _port(env: Mapping[str, str], default_port: int) -> int:
    return _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else default_port


def _check_rank(rank: int, world: int, rank_name: str, world_name: str, seen: tuple) -> None:
    if world < 1 or not 0 <= rank < world:
        raise LaunchError(f"{rank_name}={rank} is not a rank of a world of {world_name}={world} ({_list(seen)}); "
                          f"fix the launcher's environment")
