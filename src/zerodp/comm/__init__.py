"""Communication: the collectives zerodp uses (`collectives.py`), with traffic recording for tests, and
collectives over shards of unequal sizes (`uneven.py`), the watchdog and flight recorder over every blocking wait (`watchdog.py`), and the default process
group's life cycle (`process_group.py`) on the backend `backend.py` chooses.

Code elsewhere writes `from .. import comm` and calls `comm.all_reduce(...)`; everything it may call
is re-exported here.
"""

from . import topology, watchdog
from .backend import default_backend, nccl_usable, usable_backend
from .process_group import destroy_distributed, destroy_group, init_distributed, new_group_like, owns_default_group
from .collectives import (REAL_COLLECTIVES_ENV, CommLog, CommRecord, Handle, ProcessGroup,
                          add_observer, remove_observer, all_gather, all_to_all, chunk_ranges, all_gather_object, all_reduce, all_reduce_max_flag, backend_name, broadcast,
                          get_rank, get_world_size, is_initialized, record,
                          reduce_scatter, skips_collectives)
from .uneven import all_gather_uneven, reduce_scatter_uneven

__all__ = ["topology", "watchdog", "default_backend", "nccl_usable", "usable_backend", "REAL_COLLECTIVES_ENV", "CommLog", "CommRecord", "Handle", "ProcessGroup",
           "add_observer", "remove_observer", "all_gather", "all_to_all", "chunk_ranges", "all_gather_uneven", "all_gather_object", "all_reduce", "all_reduce_max_flag", "backend_name", "broadcast",
           "destroy_distributed", "destroy_group", "get_rank", "get_world_size", "init_distributed", "is_initialized", "new_group_like",
           "owns_default_group", "record",
           "reduce_scatter", "reduce_scatter_uneven", "skips_collectives"]
