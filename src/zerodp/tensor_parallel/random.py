"""Model-parallel random streams (Megatron's `CudaRNGStatesTracker`, DeepSpeed's `get_cuda_rng_tracker()`), on
CUDA or on the CPU.

Dropout inside a tensor-parallel region (attention probabilities of this rank's heads) must differ per
tensor-parallel rank, or every rank would drop the same positions of different heads; dropout on the
replicated residual stream must be the same on every tensor-parallel rank, or their copies diverge. So the
default generator is seeded alike on every rank, and a named stream ("model-parallel-rng", seeded
`seed + 2718 + tp_rank` as Megatron does) is swapped in around a tensor-parallel region:

    with tracker.fork():          # the default generator now draws from the named stream
        probs = dropout(probs)    # the stream keeps its advance on exit, the default one is restored

Anything that draws from torch's default generator (nn.Dropout, scaled_dot_product_attention's dropout)
follows. The tracker's generator is the accelerator's ("cuda" when CUDA is available, else "cpu"), decided
once, when the tracker is first used; `RNGStatesTracker(device_type="cpu")` pins it for CPU computation.
A checkpointed region saves and restores the tracker's states with torch's (activations/rng_tracker.py's
RNGSnapshot), so a recomputed forward draws the same masks. Depends on torch only.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"  # DeepSpeed's and Megatron's default name
MODEL_PARALLEL_SEED_OFFSET = 2718  # Megatron's offset: model-parallel seed = seed + 2718 + tp_rank


def default_rng_device_type() -> str:
    """"cuda" when a CUDA device can be used, else "cpu" (the generator a tracker forks)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_rng_state(device_type: str) -> torch.Tensor:
    """The default generator's state of `device_type` ("cpu", or the current "cuda" device)."""
    if device_type == "cuda":
        return torch.cuda.get_rng_state()
    if device_type == "cpu":
        return torch.get_rng_state()
    raise ValueError(f"no RNG state for device type {device_type!r}; expected 'cpu' or 'cuda'")


def set_rng_state(device_type: str, state: torch.Tensor) -> None:
    """Set the default generator of `device_type` to `state`."""
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    elif device_type == "cpu":
        torch.set_rng_state(state)
    else:
        raise ValueError(f"no RNG state for device type {device_type!r}; expected 'cpu' or 'cuda'")


def manual_seed(device_type: str, seed: int) -> None:
    """Seed only `device_type`'s default generator (torch.manual_seed would seed every device)."""
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)
    elif device_type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        raise ValueError(f"cannot seed device type {device_type!r}; expected 'cpu' or 'cuda'")


class RNGStatesTracker:
    """Named generator states (DeepSpeed's `CudaRNGStatesTracker`), on CUDA or on the CPU.

    `add(name, seed)` creates a state from `seed` without disturbing the default generator;
    `fork(name)` runs a block with that state and keeps what the block drew from it.
    """

    def __init__(self, device_type: Optional[str] = None):
        self._device_type = device_type
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    @property
    def device_type(self) -> str:
        """The generator this tracker forks: fixed at first use."""
        if self._device_type is None:
            self._device_type = default_rng_device_type()
        return self._device_type

    def reset(self) -> None:
        """Forget every named state and seed."""
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> state map (the states are immutable tensors, so a shallow copy suffices)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the name -> state map (a map from `get_states`)."""
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Track a new state `name` seeded with `seed`; each name and each seed is used once."""
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} is already tracked; each RNG state needs its own seed")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked; call reset() first to re-seed it")
        self.seeds_.add(seed)
        original = get_rng_state(self.device_type)
        manual_seed(self.device_type, seed)
        self.states_[name] = get_rng_state(self.device_type)
        set_rng_state(self.device_type, original)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with state `name`; afterwards `name` keeps its advance and the default returns."""
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not tracked; call model_parallel_cuda_manual_seed(seed) or "
                           f"get_cuda_rng_tracker().add({name!r}, seed) first")
        original = get_rng_state(self.device_type)
        set_rng_state(self.device_type, self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = get_rng_state(self.device_type)
            set_rng_state(self.device_type, original)


def seed_model_parallel(tracker: RNGStatesTracker, seed: int, tp_rank: int) -> tuple[int, int]:
    """Megatron's seeding: the default generator gets `seed` (equal on the ranks of a tensor-parallel group),
    the tracker's model-parallel state `seed + 2718 + tp_rank` (distinct). Returns (data, model) seeds."""
    model_seed = seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank
    tracker.reset()
    manual_seed(tracker.device_type, seed)
    tracker.add(MODEL_PARALLEL_RNG, model_seed)
    return seed, model_seed
