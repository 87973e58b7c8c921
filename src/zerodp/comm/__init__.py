"""Communication: the collectives zerodp uses (`collectives.py`), with traffic recording for tests, and
collectives over shards of unequal sizes (`uneven.py`), what zerodp asks of a group and the world-size-1
switch (`group.py`), the watchdog and flight recorder over every wait (`watchdog.py`), making a communicator
(`communicator.py`), and the default process group's life cycle (`process_group.py`) on the backend `backend.py`
chooses, formed from the launch environment read in one place (`launch_env.py`: torchrun, srun, mpirun), with the
node layout from the hosts the ranks run on (`topology.py`).

Code elsewhere writes `from .. import comm` and calls `comm.all_reduce(...)`; everything it may call
is re-exported here.
"""

from . import launch_env, topology, watchdog
from .backend import default_backend, gloo_serves_cpu, nccl_usable, usable_backend
from .process_group import destroy_distributed, destroy_group, init_distributed, new_group_like, owns_default_group
from .group import (REAL_COLLECTIVES_ENV, ProcessGroup, backend_name, get_rank, get_world_size, is_initialized,
                    issues_no_collectives,
                    real_collectives_requested, set_real_collectives, skips_collectives, wait_blocks_host)
from .collectives import (CommLog, CommRecord, Handle, add_observer, remove_observer, all_gather, all_to_all,
                          chunk_ranges, all_gather_object, all_reduce, all_reduce_max_flag, broadcast, record,
                          reduce_scatter)
from .uneven import all_gather_uneven, reduce_scatter_uneven

__all__ = ["launch_env", "topology", "watchdog", "default_backend", "gloo_serves_cpu", "nccl_usable", "usable_backend", "REAL_COLLECTIVES_ENV", "CommLog", "CommRecord", "Handle", "ProcessGroup",
           "add_observer", "remove_observer", "all_gather", "all_to_all", "chunk_ranges", "all_gather_uneven", "all_gather_object", "all_reduce", "all_reduce_max_flag", "backend_name", "broadcast",
           "destroy_distributed", "destroy_group", "get_rank", "get_world_size", "init_distributed", "is_initialized", "issues_no_collectives", "new_group_like",
           "owns_default_group", "real_collectives_requested", "record", "reduce_scatter", "reduce_scatter_uneven",
           "set_real_collectives", "skips_collectives", "wait_blocks_host"]
