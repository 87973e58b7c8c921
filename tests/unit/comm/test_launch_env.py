"""comm/launch_env.py without a process group: which launcher started a process and the one world it belongs to
(docs/multinode.md promises each of these readings)."""

from __future__ import annotations

import pytest

from zerodp.comm import launch_env
from zerodp.comm.launch_env import DEFAULT_MASTER_PORT, expand_hostlist, expand_tasks_per_node, export_torch_variables, read_launch_environment
from zerodp.errors import ConfigError, LaunchError


@pytest.mark.parametrize("hostlist, hosts", [
    ("node07", ["node07"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu[8-10],cpu1", ["gpu8", "gpu9", "gpu10", "cpu1"]),
    ("a[1-2]-b[01-02]", ["a1-b01", "a1-b02", "a2-b01", "a2-b02"]),
    ("n[098-101].cluster", ["n098.cluster", "n099.cluster", "n100.cluster", "n101.cluster"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["node[1-3", "node]1[", "node[a-b]", ""])
def test_a_hostlist_that_cannot_be_read_is_refused(bad):
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        expand_hostlist(bad)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(LaunchError, match="2\\(x3\\),1"):
        expand_tasks_per_node("two")


def test_no_launcher_is_one_process():
    launch = read_launch_environment({})
    assert (launch.launcher, launch.rank, launch.world_size, launch.distributed) == ("none", 0, 1, False)


def test_torchrun():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "MASTER_ADDR": "n1", "MASTER_PORT": "1234"}
    launch = read_launch_environment(env)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("torchrun", 5, 8, 1)
    assert (launch.local_world_size, launch.node_rank, launch.nodes) == (4, 1, 2)
    assert (launch.master_addr, launch.master_port) == ("n1", 1234)
    assert launch.distributed and not launch.from_scheduler


def test_torchrun_wins_over_the_scheduler_it_runs_under():
    """torchrun inside srun (one agent per node): the agent's variables say the job, not srun's tasks (2 agents)."""
    env = {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "29400",
           "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "n[1-2]",
           "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    launch = read_launch_environment(env)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("torchrun", 6, 8, 2)


def test_a_script_that_exports_rank_but_not_local_rank_gets_the_schedulers():
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "n1", "MASTER_PORT": "1", "SLURM_PROCID": "3",
           "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1"}
    assert read_launch_environment(env).local_rank == 1


def test_deepspeeds_per_node_launch_gives_the_node_hints():
    """DeepSpeed's launch.py sets LOCAL_SIZE/CROSS_RANK/CROSS_SIZE, not LOCAL_WORLD_SIZE."""
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_SIZE": "2", "CROSS_RANK": "1",
           "CROSS_SIZE": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
    launch = read_launch_environment(env)
    assert (launch.local_world_size, launch.node_rank, launch.nodes) == (2, 1, 2)


@pytest.mark.parametrize("env, missing", [({"RANK": "0"}, "WORLD_SIZE"), ({"WORLD_SIZE": "2"}, "RANK")])
def test_half_of_torchruns_variables_is_refused(env, missing):
    with pytest.raises(LaunchError, match=f"{missing} is not set.*torchrun"):
        read_launch_environment(env)


def test_slurm_step_forms_the_world_with_the_first_host_and_the_default_port():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "2", "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
           "SLURM_STEP_NODELIST": "gpu[07-09,12]", "SLURM_JOB_NODELIST": "gpu[01-20]",
           "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1"}
    launch = read_launch_environment(env)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("slurm", 5, 8, 1)
    assert (launch.local_world_size, launch.node_rank, launch.nodes) == (2, 2, 4)
    # the step's first node, not srun's launch node (maybe a login node running no rank), not the job's first
    assert (launch.master_addr, launch.master_port) == ("gpu07", DEFAULT_MASTER_PORT)
    assert launch.torch_variables() == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                        "GROUP_RANK": "2", "MASTER_ADDR": "gpu07", "MASTER_PORT": "29500"}


def test_master_addr_and_port_set_by_the_user_win():
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "a[1-2]", "MASTER_ADDR": "ib-a1",
           "MASTER_PORT": "40000"}
    launch = read_launch_environment(env)
    assert (launch.master_addr, launch.master_port) == ("ib-a1", 40000)


def test_slurm_batch_script_is_one_process_or_refused():
    """The batch script has SLURM_PROCID=0 and the allocation's SLURM_NTASKS but no step: it is not a task."""
    assert not read_launch_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).distributed
    # `srun --ntasks 1 zerodp train --nproc N`: one task, which launches its own ranks
    assert not read_launch_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1",
                                        "SLURM_STEP_NODELIST": "n1"}).distributed
    with pytest.raises(LaunchError, match="batch script.*srun python train.py.*srun --ntasks 1 zerodp train"):
        read_launch_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]"})


def test_slurm_without_a_node_list_on_several_nodes_is_refused_naming_what_it_saw():
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2"}
    with pytest.raises(LaunchError) as err:
        read_launch_environment(env)
    message = str(err.value)
    assert "SLURM_PROCID=1" in message and "SLURM_STEP_NUM_NODES=2" in message
    assert "export MASTER_ADDR" in message and "torchrun" in message
    assert isinstance(err.value, ConfigError)  # the CLI prints it as one line, exit 2


def test_slurm_on_one_node_without_a_node_list_uses_localhost():
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1"}
    assert read_launch_environment(env).master_addr == "127.0.0.1"


def test_open_mpi():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "h0"}
    launch = read_launch_environment(env)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("openmpi", 3, 4, 1)
    assert (launch.local_world_size, launch.nodes, launch.master_addr) == (2, 2, "h0")


def test_open_mpi_over_nodes_without_master_addr_is_refused():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(LaunchError, match="OMPI_COMM_WORLD_SIZE=4.*mpirun -x MASTER_ADDR"):
        read_launch_environment(env)


def test_open_mpi_under_a_slurm_allocation_reads_mpis_rank():
    """mpirun inside an allocation: the processes inherit its daemons' SLURM variables, not their rank."""
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
           "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "4"}
    assert read_launch_environment(env).rank == 3


def test_mpich_and_srun_pmi():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    launch = read_launch_environment(env)
    assert (launch.launcher, launch.rank, launch.world_size, launch.master_addr) == ("mpich", 1, 2, "127.0.0.1")
    srun_pmi = {"PMI_RANK": "1", "PMI_SIZE": "4", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4",
                "SLURM_STEP_NODELIST": "n[1-2]"}
    assert read_launch_environment(srun_pmi).launcher == "slurm"  # srun's own PMI: SLURM's node list says more


def test_pmix_alone_is_refused():
    with pytest.raises(LaunchError, match="PMIX_RANK=2.*world size"):
        read_launch_environment({"PMIX_RANK": "2"})


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(LaunchError, match="SLURM_PROCID=4 is not a rank"):
        read_launch_environment({"SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "1"})


def test_export_makes_torchruns_variables_and_a_second_reading_names_the_scheduler():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    export_torch_variables(read_launch_environment(env), env)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")} == \
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert read_launch_environment(env).launcher == "openmpi"
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    export_torch_variables(read_launch_environment(torchrun), torchrun)  # torchrun's own: left as it is
    assert "ZERODP_LAUNCHER" not in torchrun


def test_local_rank_is_read_in_one_place():
    assert launch_env.local_rank({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "3",
                                  "SLURM_STEP_NUM_NODES": "1"}) == 3
    assert launch_env.local_rank({"LOCAL_RANK": "2", "RANK": "2", "WORLD_SIZE": "4"}) == 2
    assert launch_env.local_rank({}) == 0


def test_zerodp_trains_default_out_is_one_folder_for_every_rank(monkeypatch):
    from zerodp.tools.app.train_args import default_out
    from zerodp.errors import UsageError

    for key in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK",
                "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1",
                       "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3"}.items():
        monkeypatch.setenv(key, value)
    assert default_out() == "runs/train-slurm77.3"
    for key in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    with pytest.raises(UsageError, match="openmpi.*pass --out DIR"):
        default_out()


def _only(monkeypatch, env: dict) -> None:
    import os

    prefixes = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL")
    for key in list(os.environ):
        if key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ZERODP_LAUNCHER") \
                or key.startswith(prefixes):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


MPIRUN_2 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


def test_deepspeed_auto_mpi_discovery_false_refuses_a_scheduler_launch(monkeypatch):
    import zerodp.deepspeed as deepspeed

    _only(monkeypatch, MPIRUN_2)
    with pytest.raises(LaunchError, match="auto_mpi_discovery=False.*openmpi.*OMPI_COMM_WORLD_SIZE=2.*"
                                          "auto_mpi_discovery=True"):
        deepspeed.init_distributed(auto_mpi_discovery=False)


def test_deepspeed_distributed_port_is_the_discovered_worlds_port(monkeypatch):
    from zerodp.deepspeed import _launch_environment

    _only(monkeypatch, MPIRUN_2)
    assert _launch_environment(True, 31337).master_port == 31337
    monkeypatch.setenv("MASTER_PORT", "40001")  # the user's MASTER_PORT wins (DeepSpeed's discovery overwrites it)
    assert _launch_environment(True, 31337).master_port == 40001


def test_zerodp_initialize_refuses_before_training(monkeypatch):
    """The same refusal from zerodp.initialize (before any model work): never a world of one."""
    import torch

    import zerodp

    _only(monkeypatch, {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2"})
    with pytest.raises(LaunchError, match="srun started 4 tasks"):
        zerodp.initialize(torch.nn.Linear(2, 2), None, {"train_micro_batch_size_per_gpu": 1,
                                                        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})


def test_a_pytorchjob_pod_is_a_torchrun_rank():
    """Kubeflow's PyTorchJob sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (one process per pod)."""
    env = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2"}
    launch = read_launch_environment(env)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("torchrun", 2, 3, 0)
    assert launch.distributed and (launch.master_addr, launch.master_port) == ("job-master-0", 23456)


@pytest.mark.parametrize("env, name", [
    ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one'"),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2x", "SLURM_STEP_NUM_NODES": "1"}, "SLURM_STEP_NUM_TASKS='2x'"),
])
def test_a_variable_that_is_not_a_number_is_refused(env, name):
    with pytest.raises(LaunchError, match=f"{name} is not a whole number"):
        read_launch_environment(env)


def test_deepspeed_init_distributed_arguments_must_match_the_environment(monkeypatch):
    import zerodp.deepspeed as deepspeed

    _only(monkeypatch, MPIRUN_2)
    with pytest.raises(LaunchError, match="world_size=8.*says world_size=2.*openmpi"):
        deepspeed.init_distributed(world_size=8)
    with pytest.raises(LaunchError, match="init_method='tcp://h:1'.*drop init_method"):
        deepspeed.init_distributed(init_method="tcp://h:1")
    _only(monkeypatch, {})
    with pytest.raises(LaunchError, match="rank=1, world_size=2.*says rank=0, world_size=1"):
        deepspeed.init_distributed(rank=1, world_size=2)
