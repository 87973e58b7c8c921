"""Stage 3 at evaluation and generation: flat units that stay gathered between forwards (`InferenceCache`).

In training, every unit is gathered for its forward and released after it, because its backward
comes and the memory is needed for activations. An inference forward (the unit's module in eval
mode and grad disabled: `torch.no_grad()`, `torch.inference_mode()`, HF `generate()`) has no
backward, and generation runs the same forward once per new token: re-gathering every unit per token
made a 4-layer GPT-2 generate 11x slower than the unsharded model. So, in inference forwards only,
a flat unit's gathered values are kept after its forward, while the kept elements fit the budget

    budget = min(stage3_inference_memory_fraction x free memory / element size, stage3_max_live_parameters)

(elements of gathered parameters, persistent units excluded, on top of what a forward needs at once;
free memory is the device's, or the host's on CPU, measured when an inference session begins and
agreed across ranks by a MIN all-reduce, so every rank keeps the same units and issues the same gathers).

Each flat unit's residency is one enum with asserted transitions (`Residency`):

    TRANSIENT --kept after an inference forward--> KEPT --evicted / released--> TRANSIENT

A KEPT unit carries one extra hold (`FlatUnit.holders`) owned by this cache, so the next forward's
acquire finds it GATHERED and issues no collective, and nothing else changes for it.

[Note: eviction order]
Beyond the budget, kept units are released least recently used first, but never one already used in
the current forward pass: generation walks the units in the same cyclic order every token, and plain
LRU on a cyclic scan evicts exactly the unit needed next, so with a budget of a quarter of the model
it would keep nothing useful and gather the whole model every token. With the guard, the units kept
first stay (a fixed quarter of the model is never re-gathered) and only units no longer in use (another
model path, a different sub-model) are evicted. A unit that does not fit is simply released as in training.

Everything kept is released (`release_all`) when training resumes or the values change: the next
forward that is not an inference forward (`model.train()`, or grad enabled), `engine.train()`, the
start of every engine backward (which precedes every optimizer step), and a checkpoint load.
"""

from __future__ import annotations

import collections
from enum import Enum, auto
from typing import TYPE_CHECKING, Optional

import psutil
import torch

from ... import comm

if TYPE_CHECKING:
    from .flat_unit import FlatUnit
    from .shard_group import ShardGroup


class Residency(Enum):
    TRANSIENT = auto()  # released when its last forward/backward hold is dropped (training behaviour)
    KEPT = auto()       # held gathered by the inference cache between forwards


def is_inference_forward(module: torch.nn.Module) -> bool:
    """A forward with no backward to come: the module in eval mode and grad disabled."""
    return not module.training and not torch.is_grad_enabled()


def free_memory_bytes(device: torch.device) -> int:
    """Bytes this process could still allocate on `device` (the host's available memory on CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


class InferenceCache:
    """The flat units kept gathered between inference forwards; see the module docstring."""

    def __init__(self, shards: "ShardGroup", device: torch.device, element_size: int, memory_fraction: float,
                 max_live_numel: int) -> None:
        self.shards = shards
        self.device = device              # where the gathered buffers live (its free memory sets the budget)
        self.element_size = element_size  # bytes per gathered element
        self.memory_fraction = memory_fraction
        self.max_live_numel = max_live_numel
        self.budget_numel: Optional[int] = None  # set when a session begins, None outside sessions
        self.kept_numel = 0
        self.passes = 0  # inference forward passes since the engine was built
        # LRU order (least recently used first): id(flat) -> (flat, the pass that last used it)
        self._kept: collections.OrderedDict[int, tuple["FlatUnit", int]] = collections.OrderedDict()

    @property
    def kept(self) -> list["FlatUnit"]:
        """The kept units, least recently used first."""
        return [f for f, _ in self._kept.values()]

    def begin_pass(self) -> None:
        """An inference forward of the root starts; the first of a session fixes the budget (a collective)."""
        self.passes += 1
        if self.budget_numel is not None:
            return
        if self.memory_fraction <= 0 or self.max_live_numel <= 0:
            self.budget_numel = 0
            return
        # note: a collective, once per session; every rank runs the same root forward, so all are here
        free = torch.tensor([free_memory_bytes(self.device)], dtype=torch.float64, device=self.device)
        comm.all_reduce(free, self.shards.control_group, op=torch.distributed.ReduceOp.MIN, tag="control")
        by_memory = int(self.memory_fraction * float(free.item()) / self.element_size)
        self.budget_numel = min(by_memory, self.max_live_numel)

    def keep_after_forward(self, flats: list["FlatUnit"]) -> None:
        """An inference forward released `flats`: keep those that fit (called before the release)."""
        if self.budget_numel is None:
            return  # a sub-module's forward run directly, outside any root pass: behave as in training
        for f in flats:
            if f.persistent:
                continue
            entry = self._kept.get(id(f))
            if entry is not None:
                assert f.residency is Residency.KEPT
                self._kept[id(f)] = (f, self.passes)
                self._kept.move_to_end(id(f))
                continue
            numel = f.layout.padded_numel
            if numel > self.budget_numel:
                continue
            self._evict_until(self.budget_numel - numel)  # [Note: eviction order]
            if self.kept_numel + numel <= self.budget_numel:
                f.keep()
                self._kept[id(f)] = (f, self.passes)
                self.kept_numel += numel

    def _evict_until(self, target_numel: int) -> None:
        """Release least recently used units not used in this pass until at most `target_numel` are kept."""
        while self.kept_numel > target_numel and self._kept:
            flat, last_pass = next(iter(self._kept.values()))
            if last_pass >= self.passes:
                return  # everything left was used in this pass ([Note: eviction order])
            self._drop(flat)

    def _drop(self, flat: "FlatUnit") -> None:
        del self._kept[id(flat)]
        self.kept_numel -= flat.layout.padded_numel
        flat.unkeep()

    def release_all(self) -> None:
        """Training resumes or the parameters change: release every kept unit and end the session."""
        for flat in self.kept:
            self._drop(flat)
        assert self.kept_numel == 0
        self.budget_numel = None
