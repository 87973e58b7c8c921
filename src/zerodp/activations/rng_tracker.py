"""Random-number states of a checkpointed region: the snapshot that lets a recomputation draw the same
dropout masks as the forward it repeats. The tracker of named states lives in tensor_parallel/random.py
(re-exported here).

Two kinds of state matter to a checkpointed region (Megatron's scheme, which DeepSpeed's
`CudaRNGStatesTracker` keeps):
  - the default generators (CPU, and the current CUDA device's when CUDA is in use): dropout outside
    tensor-parallel regions, equal across the ranks of a tensor-parallel group;
  - named states in the tracker (`fork("model-parallel-rng")`): dropout inside tensor-parallel
    regions, different on each tensor-parallel rank.
`RNGSnapshot.capture` records all of them before a region's forward, and `restored()` puts them back
around the recomputation, then returns every generator to where backward had left it. Exactness
rests on this: a recomputed dropout mask equal to the forward's.

The tracker's generator is the accelerator's ("cuda" when CUDA is available, else "cpu": on a CPU
run it swaps the CPU generator's state), decided once, when the tracker is first used; tests pin it
with `RNGStatesTracker(device_type=...)`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from ..tensor_parallel.random import (MODEL_PARALLEL_RNG, MODEL_PARALLEL_SEED_OFFSET, RNGStatesTracker, default_rng_device_type, get_rng_state, manual_seed, seed_model_parallel, set_rng_state)


@dataclass
class RNGSnapshot:
    """Every generator state a region may draw from, taken before its forward."""

    cpu: torch.Tensor
    cuda: Optional[torch.Tensor]
    tracker: RNGStatesTracker
    tracked: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def capture(cls, tracker: RNGStatesTracker) -> "RNGSnapshot":
        # Only an initialized CUDA context has a state worth keeping; querying would create one otherwise.
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(torch.get_rng_state(), cuda, tracker, tracker.get_states())

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run the block with the captured states, then put back the states it found."""
        now = RNGSnapshot.capture(self.tracker)
        self._apply()
        try:
            yield
        finally:
            now._apply()

    def _apply(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        self.tracker.set_states(self.tracked)
