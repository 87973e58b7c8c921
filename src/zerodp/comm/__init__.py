"""Communication: the collectives zerodp uses (`collectives.py`), with traffic recording for tests, and
collectives over shards of unequal sizes (`uneven.py`), what zerodp asks of a group and the world-size-1
switch (`group.py`), the watchdog and flight recorder over every wait (`watchdog.py`), making a communicator
(`communicator.py`), and the default process group's life cycle (`process_group.py`) on the backend `backend.py`
chooses, formed from the launch environment read in one place (`launch_env.py`: torchrun, srun, mpirun), with the
node layout from the hosts the ranks run on (`topology.py`).

Code elsewhere writes `from .. import comm` and calls `comm.all_reduce(...)`; everything it may call
is re-exported here. comm keeps no module state: what it remembers between calls is one `CommState`
(`process_state.py`) that the engine's Runtime owns and installs.

Modules:
    backend.py        Which torch.distributed backend a rank uses: NCCL where this process sees a GPU, gloo ...
    collectives.py    The collectives zerodp uses, as functions returning handles. Backend differences live here ...
    communicator.py   Making a communicator: torch's `new_group`, handed out only once every member has connected to ...
    elastic_attempt.py  The attempt of an elastic job, agreed by every rank on every node through the job's store.
    group.py          What zerodp asks of a process group: its rank, size and backend, whether its collectives are ...
    local_groups.py   Communicators that only some ranks make: `local_group` and `give_back`.
    launch_env.py     The launch environment read in one place: torchrun, srun (SLURM), mpirun (Open MPI, MPICH), PMIx
    module_device.py  The device a rank's model trains on, and moving a model built on the CPU there.
    pairwise.py       Reduce-scatter and all-gather as direct pairwise exchanges, for gloo: ...
    process_group.py  The default process group's life cycle: created from torchrun's environment, owned by its ...
    process_state.py  CommState: everything comm remembers between calls, one object the engine's Runtime owns.
    quantize.py       Block-wise symmetric quantization: the arithmetic of ZeRO++'s quantized collectives (qwZ, qgZ).
    quantized.py      ZeRO++'s quantized collectives (Wang et al. 2023, arXiv 2306.10209), opt-in approximations:
    topology.py       Which node each rank runs on, and which collectives cross nodes.
    uneven.py         Collectives over shards of unequal sizes: `all_gather_uneven`, `reduce_scatter_uneven`.
    watchdog.py       No silent hang: a watchdog over every blocking collective wait, and a flight recorder.
"""

from . import launch_env, topology, watchdog
from .backend import default_backend, gloo_serves_cpu, nccl_usable, usable_backend
from .process_group import destroy_distributed, destroy_group, init_distributed, new_group_like, owns_default_group
from .group import (REAL_COLLECTIVES_ENV, ProcessGroup, backend_name, get_rank, get_world_size, is_initialized,
                    issues_no_collectives,
                    real_collectives_requested, skips_collectives, wait_blocks_host)
from .collectives import (CommLog, CommRecord, Handle, add_observer, observers, remove_observer, all_gather, all_to_all,
                          chunk_ranges, all_gather_object, all_reduce, all_reduce_max_flag, broadcast, record,
                          reduce_scatter)
from .uneven import all_gather_uneven, reduce_scatter_uneven

__all__ = ["launch_env", "topology", "watchdog", "default_backend", "gloo_serves_cpu", "nccl_usable", "usable_backend", "REAL_COLLECTIVES_ENV", "CommLog", "CommRecord", "Handle", "ProcessGroup",
           "add_observer", "observers", "remove_observer", "all_gather", "all_to_all", "chunk_ranges", "all_gather_uneven", "all_gather_object", "all_reduce", "all_reduce_max_flag", "backend_name", "broadcast",
           "destroy_distributed", "destroy_group", "get_rank", "get_world_size", "init_distributed", "is_initialized", "issues_no_collectives", "new_group_like",
           "owns_default_group", "real_collectives_requested", "record", "reduce_scatter", "reduce_scatter_uneven",
           "skips_collectives", "wait_blocks_host"]
