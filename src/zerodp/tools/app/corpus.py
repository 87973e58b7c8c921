"""A byte-level text corpus that exists on every machine: the Python standard library's source.

The text is the concatenation of the stdlib's ``*.py`` files (from ``sysconfig``), walked in
sorted order, without ``site-packages`` and test directories, cut at ``max_bytes``. Tokens are
raw bytes (vocabulary 256), so there is no tokenizer to download either. The corpus depends on
the Python version installed, and on nothing else.

Batch invariant (what multi-rank parity tests rely on): the window offsets of a step are drawn
from a generator seeded by (seed, split, step, micro_step) alone, ``world_size * micro_batch`` of
them, and rank r gets the slice ``[r*micro_batch, (r+1)*micro_batch)``. Concatenating the ranks'
batches in rank order therefore gives ``global_batch(step, world_size * micro_batch, ...)``, and
the global batch of a step does not depend on how it is split across ranks.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig

import torch

DEFAULT_MAX_BYTES = 8 * 1024 * 1024
_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


@functools.lru_cache(maxsize=4)
def read_stdlib_bytes(max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The first ``max_bytes`` of the stdlib sources, files in sorted walk order (cached)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place fixes os.walk's descent order as well as the file order.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for filename in sorted(f for f in filenames if f.endswith(".py")):
            with open(os.path.join(dirpath, filename), "rb") as f:
                chunk = f.read() + b"\n"
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    return b"".join(chunks)


def _step_seed(seed: int, split: str, step: int, micro_step: int) -> int:
    """A 63-bit generator seed that is a deterministic function of the batch's coordinates."""
    key = f"{seed}:{split}:{step}:{micro_step}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class ByteCorpus:
    """Byte tokens split into ``train`` and ``val`` (the last ``val_fraction`` of the text)."""

    vocab_size = 256

    def __init__(self, data: bytes, val_fraction: float = 0.05):
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        n_val = int(len(tokens) * val_fraction)
        self.train = tokens[: len(tokens) - n_val]
        self.val = tokens[len(tokens) - n_val :]

    @classmethod
    def from_stdlib(
        cls, max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.05
    ) -> "ByteCorpus":
        """The stdlib corpus; the file walk happens once per process and ``max_bytes``."""
        return cls(read_stdlib_bytes(max_bytes), val_fraction)

    @staticmethod
    def encode(text: str) -> torch.Tensor:
        """UTF-8 bytes of ``text`` as a uint8 tensor."""
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)

    @staticmethod
    def decode(tokens: torch.Tensor | list[int]) -> str:
        """Text from byte tokens; invalid UTF-8 sequences become U+FFFD."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.flatten().tolist()
        return bytes(tokens).decode("utf-8", errors="replace")

    def _split(self, split: str) -> torch.Tensor:
        if split == "train":
            return self.train
        if split == "val":
            return self.val
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")

    def _offsets(
        self, step: int, n_windows: int, seq_len: int, micro_step: int, split: str, seed: int
    ) -> torch.Tensor:
        data = self._split(split)
        n_starts = len(data) - seq_len  # a window needs seq_len + 1 bytes (inputs and targets)
        if n_starts <= 0:
            raise ValueError(f"{split} split has {len(data)} bytes, too few for seq_len={seq_len}")
        generator = torch.Generator().manual_seed(_step_seed(seed, split, step, micro_step))
        return torch.randint(0, n_starts, (n_windows,), generator=generator)

    def _windows(
        self, offsets: torch.Tensor, seq_len: int, split: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        data = self._split(split)
        window = data[offsets[:, None] + torch.arange(seq_len + 1)].long()
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def global_batch(
        self,
        step: int,
        global_batch_size: int,
        seq_len: int,
        micro_step: int = 0,
        split: str = "train",
        seed: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All windows of one (step, micro_step): inputs and next-byte targets, int64 (G, T)."""
        offsets = self._offsets(step, global_batch_size, seq_len, micro_step, split, seed)
        return self._windows(offsets, seq_len, split)

    def batch(
        self,
        step: int,
        rank: int,
        world_size: int,
        micro_batch: int,
        seq_len: int,
        micro_step: int = 0,
        split: str = "train",
        seed: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s slice of the global batch: int64 (micro_batch, seq_len) tensors."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        offsets = self._offsets(step, world_size * micro_batch, seq_len, micro_step, split, seed)
        return self._windows(offsets[rank * micro_batch : (rank + 1) * micro_batch], seq_len, split)
