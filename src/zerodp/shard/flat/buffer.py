"""One contiguous tensor laid out by a `FlatLayout`, with a view per parameter and a view per shard.

Parameters and gradients live in flat buffers so that a whole bucket is one collective, and so that
a rank's shard is a plain slice (no gather/scatter copies). Storage can be released and re-allocated
in place: see [Note: freeing storage] (host_memory.py).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from .layout import FlatLayout

class FlatBuffer:
    """A padded 1-D tensor for the parameters of a `FlatLayout`, sharded into `layout.num_shards` slices."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device,
                 data: Optional[torch.Tensor] = None) -> None:
        self.layout = layout
        if data is None:
            data = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        if data.numel() != layout.padded_numel or data.dim() != 1:
            raise ValueError(f"flat buffer needs a 1-D tensor of {layout.padded_numel} elements, "
                             f"got shape {tuple(data.shape)}")
        self.tensor = data
        self._views: Optional[tuple[torch.Tensor, ...]] = None  # made once, see views()
        self._aliases: Optional[tuple[torch.Tensor, ...]] = None  # made once, see aliases()

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def nbytes(self) -> int:
        """Bytes currently allocated (0 when the storage is freed)."""
        return self.tensor.untyped_storage().size()

    def view(self, index: int) -> torch.Tensor:
        """The parameter `index`'s elements, shaped like the parameter (a cached view: do not reshape it in place)."""
        return self.views()[index]

    def views(self) -> tuple[torch.Tensor, ...]:
        """Every parameter's view, in layout order. Made once: a view shares the buffer's storage object, so it
        stays valid across `free_storage`/`alloc_storage`, and a gradient hook that runs once per parameter per
        backward would otherwise pay a slice and a reshape (two dispatcher calls) each time."""
        if self._views is None:
            t, layout = self.tensor, self.layout
            self._views = tuple(t[off:off + n].view(shape)
                                for off, n, shape in zip(layout.offsets, layout.numels, layout.shapes))
        return self._views

    def aliases(self) -> tuple[torch.Tensor, ...]:
        """Every parameter's elements as a tensor of its own over the buffer's storage (`set_`): the memory of
        `views()`, but each with its own version counter, where views share their base's. An in-place add into
        one (autograd accumulating a gradient into a `.grad`) then shows on that tensor alone, which is how a
        bucket tells which of its parameters got a gradient without a hook per parameter ([Note: arrivals read
        from version counters] in grads/bucket_intake.py). Made once, while the storage exists, like the views."""
        if self._aliases is None:
            t, layout = self.tensor, self.layout
            storage, base = t.untyped_storage(), t.storage_offset()
            self._aliases = tuple(torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, base + off, shape)
                                  for off, shape in zip(layout.offsets, layout.shapes))
        return self._aliases

    def shard(self, shard: int) -> torch.Tensor:
        """The slice owned by `shard` (a view: writes go to the buffer)."""
        lo, hi = self.layout.shard_range(shard)
        return self.tensor[lo:hi]

    def copy_from(self, tensors: Iterable[torch.Tensor]) -> None:
        """Fill the buffer from tensors in layout order; padding is zeroed."""
        for i, t in enumerate(tensors):
            self.view(i).copy_(t.detach())
        self.zero_padding()

    def zero_padding(self) -> None:
        """Zero the elements that belong to no parameter (the end, or gaps between whole-tensor shards)."""
        for lo, hi in self.layout.padding_ranges():
            self.tensor[lo:hi].zero_()
