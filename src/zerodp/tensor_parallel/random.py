"""Model-parallel random streams (Megatron's `CudaRNGStatesTracker`), on CPU and CUDA.

Dropout inside a tensor-parallel region (attention probabilities of this rank's heads) must differ per
tensor-parallel rank, or every rank would drop the same positions of different heads; dropout on the
replicated residual stream must be the same on every tensor-parallel rank, or their copies diverge. So
the default generators are seeded alike on every rank, and a named extra stream ("model-parallel-rng",
seeded `seed + 2718 + tp_rank` as Megatron does) is swapped in around a tensor-parallel region:

    with tracker.fork():          # the default CPU (and CUDA) generator now draws from the named stream
        probs = dropout(probs)    # its state is saved back on exit, the default stream restored

Anything that draws from torch's default generators (nn.Dropout, scaled_dot_product_attention's dropout)
follows. A checkpoint of activations saves and restores `get_states()` with torch's own states, so a
recomputed forward draws the same masks. Depends on torch only.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
MODEL_PARALLEL_SEED_OFFSET = 2718  # Megatron's: keeps the model-parallel streams away from the default one


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class RNGStatesTracker:
    """Named generator states, swapped into torch's default generators by `fork(name)`."""

    def __init__(self) -> None:
        self._states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def reset(self) -> None:
        self._states = {}

    def get_states(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """A copy of every named state (CPU state, CUDA state or None)."""
        return {name: (cpu.clone(), None if cuda is None else cuda.clone()) for name, (cpu, cuda) in self._states.items()}

    def set_states(self, states: dict) -> None:
        self._states = {name: (cpu.clone(), None if cuda is None else cuda.clone()) for name, (cpu, cuda) in states.items()}

    def add(self, name: str, seed: int) -> None:
        """A new stream `name` starting from `seed` (torch's default generators are left as they were)."""
        if name in self._states:
            raise ValueError(f"random stream {name!r} exists already; call reset() first to re-seed it")
        cpu_before = torch.get_rng_state()
        cuda_before = torch.cuda.get_rng_state() if _cuda_ready() else None
        torch.manual_seed(seed)
        self._states[name] = (torch.get_rng_state(), torch.cuda.get_rng_state() if _cuda_ready() else None)
        torch.set_rng_state(cpu_before)
        if cuda_before is not None:
            torch.cuda.set_rng_state(cuda_before)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream `name` inside the block; torch's default streams continue unchanged after it."""
        if name not in self._states:
            raise KeyError(f"random stream {name!r} was never added; call seed_model_parallel(tracker, seed, tp_rank) "
                           f"or tracker.add({name!r}, seed) first")
        cpu, cuda = self._states[name]
        cpu_before = torch.get_rng_state()
        cuda_before = torch.cuda.get_rng_state() if _cuda_ready() else None
        torch.set_rng_state(cpu)
        if cuda is not None and cuda_before is not None:
            torch.cuda.set_rng_state(cuda)
        try:
            yield
        finally:
            self._states[name] = (torch.get_rng_state(),
                                  torch.cuda.get_rng_state() if cuda_before is not None else cuda)
            torch.set_rng_state(cpu_before)
            if cuda_before is not None:
                torch.cuda.set_rng_state(cuda_before)


def seed_model_parallel(tracker: RNGStatesTracker, seed: int, tensor_parallel_rank: int) -> None:
    """Seed torch's default generators with `seed` (alike on every rank) and `tracker`'s model-parallel stream
    with `seed + 2718 + tensor_parallel_rank` (Megatron's `model_parallel_cuda_manual_seed`)."""
    torch.manual_seed(seed)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tensor_parallel_rank)
