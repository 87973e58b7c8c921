"""One offloaded stage-3 shard as `shard_store.ShardStore` tracks it: its tensor, backing store and state.

States (asserted on every transition; see the store's docstring for who moves them):

    OFFLOADED --read--> READING --wait--> RESIDENT --evict, dirty: write--> WRITING --done--> OFFLOADED
                                          RESIDENT --evict, clean--> OFFLOADED
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Optional

import torch

from .file_io import DONE, IOHandle


class ShardHome(Enum):
    OFFLOADED = auto()  # storage freed; the values are only in the backing store
    READING = auto()    # storage attached, read in flight
    RESIDENT = auto()   # values in memory (`dirty`: newer than the backing store)
    WRITING = auto()    # write-back in flight; storage freed when it completes


_ALLOWED = {
    ShardHome.OFFLOADED: {ShardHome.READING},
    ShardHome.READING: {ShardHome.RESIDENT},
    ShardHome.RESIDENT: {ShardHome.WRITING, ShardHome.OFFLOADED},
    ShardHome.WRITING: {ShardHome.OFFLOADED, ShardHome.RESIDENT},
}


class ShardEntry:
    """One shard: its tensor, its backing store, its state."""

    def __init__(self, index: int, shard: torch.Tensor, backing) -> None:
        self.index = index
        self.shard = shard
        self.numel = shard.numel()
        self.backing = backing
        self.state = ShardHome.RESIDENT
        self.users = 0
        self.dirty = False
        self.handle: IOHandle = DONE
        self.zero = False   # the values are all zeros, whatever the backing store holds
        self.staging: Optional[torch.Tensor] = None  # host copy of a GPU shard while its I/O is in flight

    def to(self, state: ShardHome) -> None:
        assert state in _ALLOWED[self.state], f"shard {self.index}: {self.state.name} -> {state.name}"
        self.state = state
