"""Which torch.distributed backend a rank uses: NCCL where this process sees a GPU, gloo otherwise.

[Note: NCCL built is not a GPU present] A CUDA build of torch (PyPI's default wheel) has NCCL built in on
a machine without a GPU too: `torch.distributed.is_nccl_available()` is True there, and a group that asks
for NCCL fails at creation ("ProcessGroupNCCL is only supported with GPUs, no GPUs found!"). So every
backend choice asks `torch.cuda.is_available()`; `is_nccl_available()` only says whether a NCCL entry
could work at all. The choices are functions of those two answers (`choose_backend`,
`usable_backend_entries`), so the CPU suite checks them with the answers given as data.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def nccl_usable() -> bool:
    """NCCL can serve this process: built into torch AND a GPU is visible (see the Note above)."""
    return dist.is_nccl_available() and torch.cuda.is_available()


def choose_backend(cuda_available: bool, nccl_built: bool = True) -> str:
    """The default group's backend: "nccl" with a visible GPU (and NCCL built), else "gloo"."""
    return "nccl" if cuda_available and nccl_built else "gloo"


def default_backend() -> str:
    """`choose_backend` for this process."""
    return choose_backend(torch.cuda.is_available(), dist.is_nccl_available())


def nccl_serves_cuda(backend: str) -> bool:
    """Does a group of `backend` (as `dist.get_backend` names it) reduce CUDA tensors with NCCL? "nccl" and
    DeepSpeed's device list "cpu:gloo,cuda:nccl" do (torch keeps the list as the group's backend name)."""
    entries = [e.strip().lower() for e in backend.split(",")]
    return any(e == "nccl" or [p.strip() for p in e.split(":", 1)] == ["cuda", "nccl"] for e in entries)


def gloo_serves_cpu(backend: str) -> bool:
    """Does a group of `backend` (as `dist.get_backend` names it) reduce CPU tensors with gloo? "gloo" and
    "cpu:gloo,cuda:nccl" do. Such a group connects its ranks when it is made ([Note: a communicator is made when
    every member has connected] in communicator.py)."""
    entries = [e.strip().lower() for e in backend.split(",")]
    return any(e == "gloo" or [p.strip() for p in e.split(":", 1)] == ["cpu", "gloo"] for e in entries)


def usable_backend_entries(dist_backend: str, available: dict[str, bool]) -> str:
    """`dist_backend` ("cpu:gloo,cuda:nccl") without the `device:backend` entries that cannot serve here.

    `available` maps a backend name to whether it can serve (nccl: built and a GPU visible); an entry whose
    backend is not named is kept. A plain name ("nccl") is returned as given: torch names the problem."""
    if ":" not in dist_backend:
        return dist_backend
    entries = [e.strip() for e in dist_backend.split(",") if e.strip()]
    kept = [e for e in entries if available.get(e.split(":", 1)[1].strip(), True)]
    if not kept:
        raise RuntimeError(f"init_distributed(dist_backend={dist_backend!r}): none of these backends can serve "
                           f"this process (NCCL needs a visible GPU and a torch built with it); pass one that can "
                           f"(gloo on CPU)")
    return ",".join(kept)


def usable_backend(dist_backend: str) -> str:
    """`usable_backend_entries` for this process: gloo and MPI where built, NCCL where `nccl_usable()`."""
    return usable_backend_entries(dist_backend, {"gloo": dist.is_gloo_available(), "nccl": nccl_usable(),
                                                 "mpi": dist.is_mpi_available()})
