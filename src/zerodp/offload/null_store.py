"""The home of shards that are not offloaded: `NullShardStore`, a `ShardStore` that keeps nothing.

A stage-3 flat unit always holds a parameter store (stage3/flat_unit.py). With offload_param off (or
where it would change nothing, as device cpu without a GPU) that store is this one: every shard stays
in memory, so each call of `ShardStore`'s vocabulary is a no-op and `resident(...)` is an empty block.
The unit can then say `with self.param_home.resident(...)` without asking first whether offload is on,
and nothing above the unit needs to know either.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch


class NullShardStore:
    """Answers `offload.shard_store.ShardStore`'s calls for shards that never leave memory."""

    offloads = False   # ShardStore: True (the strategy reports a footprint only for a real store)
    rank_dir = None    # no folder: tier.build_grad_offload keeps gradient shards in memory too
    limit_numel = 0
    peak_resident_numel = 0

    def holds(self, shard: torch.Tensor) -> bool:
        return False

    def adopt(self, shard: torch.Tensor, zeros: bool = False) -> None:
        """Nothing to write: the shard's memory is its home."""

    def acquire(self, shard: torch.Tensor) -> None:
        """Always resident."""

    def release(self, shard: torch.Tensor, dirty: bool = False) -> None:
        """Nothing to write back."""

    def resident(self, shards: Iterable[torch.Tensor], dirty: bool = False):
        return contextlib.nullcontext()

    def all_resident(self, dirty: bool = False):
        return contextlib.nullcontext()

    def end_step(self) -> None:
        """No read-ahead to plan."""

    def offloaded_bytes(self, shard: torch.Tensor) -> int:
        return 0

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """No files."""
