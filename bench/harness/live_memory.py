"""Peak live bytes of a step: what malloc holds in use, sampled every millisecond by a thread.

"Live" is allocated bytes (glibc's mallinfo2: in-use heap chunks of every arena plus mmapped
blocks), not RSS: RSS also counts freed memory that malloc keeps, which is what the RSS column
shows. Sampling runs while the main thread is inside torch's C++ code (the GIL is released there),
so a peak shorter than the sampling period can be missed; the same probe measures every strategy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Optional

_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):
        return None  # not glibc (or glibc < 2.33): live memory is not measured


_LIBC = _libc()


def in_use_bytes() -> Optional[int]:
    """Bytes malloc has handed out and not had back (heap chunks + mmapped blocks); None off glibc."""
    if _LIBC is None:
        return None
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class PeakSampler:
    """`with PeakSampler() as s: step()`; then `s.peak` is the highest in-use bytes seen."""

    def __init__(self, period_s: float = 0.001) -> None:
        self.period_s = period_s
        self.peak: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            now = in_use_bytes()
            if now is not None and (self.peak is None or now > self.peak):
                self.peak = now
            self._stop.wait(self.period_s)

    def __enter__(self) -> "PeakSampler":
        self.peak = in_use_bytes()
        self._thread = threading.Thread(target=self._sample, name="zerodp-bench-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        now = in_use_bytes()
        if now is not None and (self.peak is None or now > self.peak):
            self.peak = now
