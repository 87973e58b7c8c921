"""cpu_checkpointing: kept checkpoint inputs moved to host memory until their recomputation.

On CUDA the host buffer is pinned and the copy runs on a side stream, so the forward does not wait
for it: the side stream first waits for the compute stream (the input must be finished), and the
source's storage is marked as used by the side stream (`record_stream`), so the caching allocator
does not hand it out again before the copy has read it. The recomputation waits for the copy's
event before copying back. On a CPU device the input is copied into a separate host tensor by the
same path, synchronously: a CPU run exercises the mechanism but saves no memory (host and device
are the same memory).

Where the copy goes is decided as data (`host_placement`), so the CUDA choices are testable here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch


@dataclass(frozen=True)
class HostPlacement:
    """Where a device's offloaded inputs live and how they get there."""

    pinned: bool       # page-locked host memory (a CUDA source: asynchronous copies)
    side_stream: bool  # copy on a side stream instead of the compute stream


def host_placement(device: torch.device) -> HostPlacement:
    """A CUDA source: pinned memory and a side stream. Anything else: plain host memory, synchronous."""
    cuda = device.type == "cuda"
    return HostPlacement(pinned=cuda, side_stream=cuda)


class HostCopy(NamedTuple):
    """One input in host memory, and the event its copy records (None when the copy was synchronous)."""

    host: torch.Tensor
    done: Optional["torch.cuda.Event"]


class HostOffload:
    """Copies inputs to host memory and back; owns the side stream of each CUDA device it has used."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, "torch.cuda.Stream"] = {}

    def put(self, tensor: torch.Tensor, out: Optional[torch.Tensor] = None) -> HostCopy:
        """Copy `tensor` into `out` (a host tensor of its numel) or a new host tensor."""
        placement = host_placement(tensor.device)
        source = tensor.detach().reshape(-1)
        if out is None:
            out = torch.empty(source.numel(), dtype=tensor.dtype, device="cpu", pin_memory=placement.pinned)
        if not placement.side_stream:
            out.copy_(source)
            return HostCopy(out, None)
        stream = self._stream(tensor.device)
        # Sync point: the side stream waits for the compute stream that produced `tensor`.
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            out.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        source.record_stream(stream)  # keep the source's memory from reuse until the copy has read it
        return HostCopy(out, done)

    @staticmethod
    def take(copy: HostCopy, device: torch.device) -> torch.Tensor:
        """The flat input back on `device` (a new tensor)."""
        if copy.done is not None:
            torch.cuda.current_stream(device).wait_event(copy.done)  # sync point: the offload copy is complete
            return copy.host.to(device, non_blocking=True)
        return copy.host.to(device, copy=True)

    def _stream(self, device: torch.device) -> "torch.cuda.Stream":
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]
