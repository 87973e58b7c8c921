"""One job or a clear stop (issue 41): processes started the way srun and mpirun start them (plain `python`, the
scheduler's variables, none of torchrun's) form one world, and train exactly what plain PyTorch trains on the
global batch; a launch that cannot form one world refuses before training, naming what it saw.

Four plain processes on this machine stand in for the scheduler's tasks (tests/e2e/launch_env_worker.py);
ZERODP_HOSTNAME puts them on two simulated hosts, so the node layout comes from the hosts, with the launcher's
per-node count as a hint that agrees (SLURM) or disagrees (Open MPI, which is told one node of 4).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e import launch_env_worker as worker
from tests.dist.common import assert_matches_reference, assert_trained, make_model, reference_run
from tests.e2e.multinode_check import free_port

REPO = Path(__file__).resolve().parents[2]
WORLD = 4
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
            "ZERODP_LAUNCHER", "ZERODP_HOSTNAME")


def _clean_env() -> dict:
    """This process's environment without any launcher's variables."""
    prefixes = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL")
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN and not k.startswith(prefixes)}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src")]))
    return env


def slurm_env(rank: int, port: int) -> dict:
    """What srun sets for task `rank` of `srun -N 2 --ntasks-per-node 2` (block distribution), plus MASTER_PORT."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_NTASKS": "4",
            "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": str(rank % 2), "SLURM_NODEID": str(rank // 2),
            "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "localhost",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_LAUNCH_NODE_IPADDR": "10.255.255.1",  # not a rank's node
            "MASTER_PORT": str(port), "ZERODP_HOSTNAME": f"node{rank // 2}"}


def open_mpi_env(rank: int, port: int) -> dict:
    """What `mpirun -np 4` sets on one node (no MASTER_ADDR: 127.0.0.1), while the hosts say 2 nodes of 2."""
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_PORT": str(port), "ZERODP_HOSTNAME": f"node{rank // 2}"}


def mpich_env(rank: int, _port: int) -> dict:
    """What `mpiexec -n 4` (MPICH's Hydra) sets on one node; no MASTER_ADDR or MASTER_PORT."""
    return {"PMI_RANK": str(rank), "PMI_SIZE": "4", "MPI_LOCALRANKID": str(rank), "MPI_LOCALNRANKS": "4"}


def _spawn(env_of, out: Path, timeout: float = 240, extra: tuple = ()) -> list[dict]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.e2e.launch_env_worker", str(out), *extra], cwd=REPO,
                              env={**_clean_env(), **env_of(rank, port)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(WORLD)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, output) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{output[-3000:]}"
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]


# ~25-40 s each on 2 busy cores (4 interpreters importing torch): Open MPI's case runs with the slow tests
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["slurm", pytest.param("openmpi", marks=pytest.mark.slow)])
def test_scheduler_tasks_form_one_world_and_match_pytorch(tmp_path, launcher):
    env_of = slurm_env if launcher == "slurm" else open_mpi_env
    results = _spawn(env_of, tmp_path)
    ref_losses, ref_params = reference_run("adamw", worker.STEPS, worker.MICRO_BS * WORLD, 0.5)
    assert_trained(ref_params, make_model().state_dict())
    for rank, result in enumerate(results):
        assert (result["rank"], result["world"]) == (rank, WORLD), "not one world of 4"
        # fp32, summation order only: the project's parity tolerance (common.assert_matches_reference)
        assert_matches_reference(rank, result["losses"], result["params"], ref_losses, ref_params, launcher)
        exported = result["exported"]
        assert (exported["RANK"], exported["WORLD_SIZE"]) == (str(rank), "4")
        assert exported["MASTER_ADDR"] == ("localhost" if launcher == "slurm" else "127.0.0.1")
        # the hosts say 2 nodes of 2, consecutive ranks: the world's collectives cross nodes
        assert result["layout"] == (2, 2, True) and result["world_crosses_nodes"]
    if launcher == "slurm":  # SLURM's 2 tasks per node agree with the hosts: no warning
        assert exported["LOCAL_RANK"] == str(3 % 2) and exported["LOCAL_WORLD_SIZE"] == "2"
        assert not any("launcher's variables say" in w for r in results for w in r["warnings"])
    else:  # Open MPI said one node of 4: one warning, on rank 0, naming both; the hosts win
        said = [w for w in results[0]["warnings"] if "launcher's variables say" in w]
        assert len(said) == 1 and "4 ranks per node" in said[0] and "OMPI_COMM_WORLD_LOCAL_SIZE=4" in said[0] \
            and "2 on 'node0'" in said[0] and "2 on 'node1'" in said[0], results[0]["warnings"]
        assert not any("launcher's variables say" in w for r in results[1:] for w in r["warnings"])


@pytest.mark.timeout(120)
def test_zerodp_train_refuses_a_slurm_launch_it_cannot_join(tmp_path):
    """srun's variables for 4 tasks on 2 nodes, but no node list and no MASTER_ADDR: one line, exit 2, nothing
    trained (before: a world of one that trained alone and exited 0)."""
    env = {**_clean_env(), "SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
           "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "2"}
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "zerodp", "train", "--model", "tiny", "--steps", "2", "--out",
                           str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zerodp: error: srun started 4 tasks"), proc.stderr
    for named in ("SLURM_PROCID=1", "SLURM_STEP_NUM_TASKS=4", "SLURM_STEP_NUM_NODES=2", "MASTER_ADDR"):
        assert named in lines[0]
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


@pytest.mark.slow  # three `zerodp train` runs of 2 ranks (~1-2 min on 2 cores)
@pytest.mark.timeout(600)
def test_zerodp_train_under_srun_trains_what_nproc_2_trains(tmp_path):
    """`srun --ntasks 2 python -m zerodp train ...` (srun's variables set by hand on 2 plain processes): one world of
    2 (one summary line), bitwise the parameters `zerodp train --nproc 2` trains, in the default folder SLURM's
    job and step ids name."""
    from tests.e2e.multinode_check import TINY
    from tests.e2e.test_train import zerodp as run_zerodp
    import zerodp

    port = free_port()
    procs = []
    for rank in range(2):
        env = {**_clean_env(), "SLURM_JOB_ID": "977", "SLURM_STEP_ID": "2", "SLURM_PROCID": str(rank),
               "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
               "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "localhost",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "zerodp", "train", *TINY, "--steps", "4"], cwd=tmp_path,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=300) for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr[-3000:]}"
    stdout = "".join(r[0] for r in results)
    assert stdout.count("zerodp train summary: stage 3, 2 rank(s)") == 1, stdout  # one world, not two of one
    out = tmp_path / "runs" / "train-slurm977.2"
    reference = tmp_path / "one-node"
    run_zerodp("train", *TINY, "--nproc", "2", "--steps", "4", "--out", str(reference), timeout=200)
    expected = zerodp.consolidate_checkpoint(reference / "checkpoints")
    got = zerodp.consolidate_checkpoint(out / "checkpoints")
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


@pytest.mark.slow  # 4 interpreters importing torch (~30-60 s on 2 busy cores)
@pytest.mark.timeout(300)
def test_deepspeed_init_distributed_forms_the_mpich_world_on_its_port(tmp_path):
    """A DeepSpeed script's `deepspeed.init_distributed(dist_backend="gloo", distributed_port=P)` under MPICH's
    mpiexec on one node (PMI_*, MPI_LOCAL*, no MASTER_*): one world of 4 at 127.0.0.1:P, exact against PyTorch."""
    port = free_port()
    results = _spawn(mpich_env, tmp_path, extra=("deepspeed", str(port)))
    ref_losses, ref_params = reference_run("adamw", worker.STEPS, worker.MICRO_BS * WORLD, 0.5)
    for rank, result in enumerate(results):
        assert (result["rank"], result["world"]) == (rank, WORLD)
        assert_matches_reference(rank, result["losses"], result["params"], ref_losses, ref_params, "mpich")
        assert (result["exported"]["MASTER_ADDR"], result["exported"]["MASTER_PORT"]) == ("127.0.0.1", str(port))
        assert result["layout"] == (4, 1, True) and not result["world_crosses_nodes"]  # one host, as MPI says
        assert not [w for w in result["warnings"] if "launcher's variables say" in w]
