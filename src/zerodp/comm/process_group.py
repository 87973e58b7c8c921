"""The default process group's life cycle: created from the launch environment (torchrun's, or a scheduler's
world made into torchrun's: launch_env.py), its ranks' hosts learned (topology.py), owned by its creator,
destroyed before interpreter shutdown (see [Note: teardown]), and made under a store prefix of its own in
every attempt of an elastic job (the attempt every node's ranks agreed on: elastic_attempt.py) and whenever it
is made again in the same process.
"""

from __future__ import annotations

import atexit
import os
from typing import Optional

import torch
import torch.distributed as dist
# [Note: a default group kept alive by default arguments] torch.distributed.nn.functional defines its collectives
# with `group=group.WORLD` as a default argument, evaluated when the module is first imported. torch imports it
# late, on its own: the first optimizer step imports torch._dynamo, which imports FSDP, which imports it. If that
# happens while a default group lives, every one of those functions keeps that group object as a default, so
# destroy_process_group() cannot free it: its gloo threads run on to interpreter shutdown, where C++ static
# destructors end them and the process sometimes aborts ("terminate called without an active exception"; 1 run
# in 12-50 of `zerodp train` under torchrun, on CPU and CUDA builds alike). Imported here, before zerodp makes
# any group, the defaults are None.
import torch.distributed.nn.functional  # noqa: F401  (imported for the side effect above)

from . import elastic_attempt, local_groups, process_state, topology, watchdog
from .launch_env import LaunchEnvironment, export_torch_variables, read_launch_environment
from .communicator import new_group, wait_for_members
from .backend import default_backend
from .group import ProcessGroup, backend_name, is_initialized, issues_no_collectives


def init_distributed(timeout_s: Optional[float] = None, launch: Optional[LaunchEnvironment] = None) -> bool:
    """Initialize torch.distributed from the launch environment, if it shows a job and it is not done yet.

    `launch`: the environment as read (default: `read_launch_environment()`, which raises LaunchError where a
    launch of several processes cannot form one world: [Note: one job or a clear stop] in launch_env.py). A
    scheduler's world (srun, mpirun) is exported as torchrun's variables first. Picks NCCL when CUDA is
    available, gloo otherwise (backend.py), then gathers every rank's host once (topology.learn_hosts). Without
    a launcher (a plain `python train.py`) nothing is initialized and zerodp runs as world size 1. Returns True
    when this call created the default process group: its creator owns it and destroys it
    (`destroy_distributed`, called by `engine.close()`), and, as a backstop, so does an atexit hook.
    """
    if is_initialized():
        return False
    launch = read_launch_environment() if launch is None else launch
    if not launch.distributed:
        return False
    export_torch_variables(launch)
    from datetime import timedelta

    backend = default_backend()  # NCCL only where a GPU is visible: [Note: NCCL built is not a GPU present]
    if timeout_s is None:
        # the backend's own timeout only backs up the watchdog, which reports first and says more
        timeout_s = watchdog.timeout_s() + 60.0
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank)
    timeout = timedelta(seconds=timeout_s)
    state = process_state.current()  # who owns the default group: the Runtime's CommState (process_state.py)
    state.groups_created += 1
    generation = state.groups_created
    attempt = elastic_attempt.current(timeout)  # under torch's elastic agent: what every node's ranks agreed on
    if attempt is not None or generation > 1:
        store = dist.PrefixStore(attempt.prefix(generation), attempt.store) if attempt is not None \
            else _fresh_store(timeout, generation)
        dist.init_process_group(backend=backend, store=store, rank=launch.rank, world_size=launch.world_size,
                                timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    wait_for_members()  # [Note: a communicator is made when every member has connected]
    state.created_group = dist.group.WORLD
    topology.learn_hosts()  # the node layout from the hosts the ranks run on (the launcher's variables are hints)
    # [Note: teardown] A process group left alive until interpreter shutdown is destroyed by C++
    # static destructors while gloo's threads still run: "terminate called without an active
    # exception", SIGABRT, and torchrun reports a finished job as failed (2 of 12 runs here). An
    # explicit destroy before shutdown joins those threads first, provided nothing else still holds
    # the group ([Note: a default group kept alive by default arguments]). atexit runs before that shutdown,
    # after the script's last line, also when it ends with an exception.
    atexit.unregister(_destroy_if_owned)  # registered once, however often a group is created
    atexit.register(_destroy_if_owned)
    return True


def _fresh_store(timeout, generation: int) -> dist.Store:
    """The rendezvous store of a default group re-created in the same process after `engine.close()` destroyed
    the first (`generation` > 1; every rank runs the same script, so every rank counts the same), with keys
    under a prefix of its own, outside torch's elastic agent (under it, elastic_attempt.py names the prefix).

    A re-created group starts torch's group counter from 0 again, so under the default prefix the new group's
    communicators would have the old ones' names and read their dead addresses: gloo fails with
    "connectFullMesh failed ... Connection refused" (pytorch/pytorch#167288 reports the same for NCCL after an
    elastic restart, where torch's agent keeps its store for the whole job: see elastic_attempt.py).
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0, timeout=timeout, multi_tenant=True)
    return dist.PrefixStore(f"zerodp/group{generation}", store)


def owns_default_group() -> bool:
    """True when the live default process group was created by `init_distributed` (so zerodp owns it)."""
    created = process_state.current().created_group
    return is_initialized() and created is not None and dist.group.WORLD is created


def _destroy_if_owned() -> None:
    if owns_default_group():
        destroy_distributed()


def destroy_distributed() -> None:
    """Destroy the default process group and every group made from it (no-op when none exists).

    No barrier first: at exit after a failure a peer may be dead, and a barrier would then wait for
    the whole timeout; a rank that got here has no collective of its own left in flight.
    """
    if is_initialized():
        dist.destroy_process_group()
    process_state.current().created_group = None
    topology.forget_hosts()  # learned under the group just destroyed


def new_group_like(group: ProcessGroup = None) -> ProcessGroup:
    """A second communicator over the ranks of `group` (same backend); only those ranks call it.

    Collectives on different communicators are matched independently, so two streams of
    collectives whose relative order may differ between ranks can each keep their own order.
    """
    if issues_no_collectives(group):
        return group
    whole_world = group is None or group is dist.group.WORLD
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    if whole_world:
        # every rank calls this: torch's counter-named, globally synchronized form, whose names never repeat
        return new_group(ranks, backend_name(group))  # [Note: a communicator is made when every member has connected]
    return local_groups.local_group(ranks, backend_name(group))  # [Note: local communicators]


def destroy_group(group: ProcessGroup, made_from: ProcessGroup = None) -> None:
    """Destroy `group`, a communicator `new_group_like(made_from)` returned, joining its threads (or keep
    one that only some ranks made, for the next engine over them: [Note: local communicators]).

    No-op where new_group_like returned `made_from` itself (one rank) or the default group is gone
    already (destroying it destroyed every group made from it). Why it matters: a gloo group left
    alive to interpreter shutdown is torn down by C++ static destructors while its threads run,
    and the process aborts ("terminate called without an active exception"; [Note: teardown]).
    """
    if group is None or group is made_from or not is_initialized():
        return
    if not local_groups.give_back(group):  # kept for the next engine over its ranks: [Note: local communicators]
        dist.destroy_process_group(group)
