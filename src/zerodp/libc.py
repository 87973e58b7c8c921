"""`libc_function`: one function of the C library through ctypes, for the memory and file calls Python does
not offer (mallopt in offload/heap.py, madvise in huge_pages.py, fallocate's hole punching in offload/store.py).

The library and each function are looked up once, on the first call (ctypes.util.find_library runs a subprocess), never at import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Callable, Optional


@functools.lru_cache(maxsize=None)
def _libc() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


@functools.lru_cache(maxsize=None)
def libc_function(name: str, argtypes: tuple, restype=ctypes.c_int) -> Optional[Callable]:
    """libc's `name` with its argument and result types set, or None where there is no such function
    (cached: hot paths such as huge_pages.advise_huge_pages call it per buffer)."""
    fn = getattr(_libc(), name, None)
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn
