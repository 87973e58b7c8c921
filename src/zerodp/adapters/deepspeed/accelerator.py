"""`deepspeed.accelerator.get_accelerator()`: the device object DeepSpeed scripts ask for the device name,
the communication backend, RNG, synchronize, memory statistics, pinned memory and streams.

Two devices, answering as DeepSpeed 0.19.8's `CPU_Accelerator` and `CUDA_Accelerator` do:

    call                         cpu                                  cuda
    device_name(i)               'cpu' (any i)                        'cuda' / 'cuda:i'
    current_device_name()        'cpu'                                'cuda:<current device>'
    communication_backend_name() 'gloo'                               'nccl'
    device_count()               LOCAL_SIZE if set, else 1 (*)        torch.cuda.device_count()
    set_device, synchronize,     no-ops                               torch.cuda's
      empty_cache
    manual_seed(_all)            torch.manual_seed                    torch.cuda.manual_seed(_all)
    memory_allocated/reserved    this process's RSS (psutil)          torch.cuda's
      max_memory_*               the largest RSS seen since reset     torch.cuda's
    total/available_memory       psutil.virtual_memory()              device properties / total - allocated
    Stream, Event                None                                 torch.cuda.Stream, torch.cuda.Event
    stream(s)                    a no-op context                      torch.cuda.stream(s)
    is_bf16_supported()          True                                 torch.cuda.is_bf16_supported()
    is_fp16_supported()          mkldnn's answer                      compute capability >= 7
    on_accelerator(t)            t is on the CPU                      t is on 'cuda:<i>'
    pin_memory(t)                t itself (torch cannot pin for CPU)  t.pin_memory()

(*) DeepSpeed counts NUMA nodes with cores when LOCAL_SIZE is unset; zerodp answers 1 (one CPU "device"
per process, which is what zerodp's CPU runs use).

The device is chosen as DeepSpeed chooses it: `DS_ACCELERATOR=cpu|cuda` if set, else CUDA when
torch sees a GPU, else the CPU. Other DeepSpeed accelerators (xpu, npu, hpu, mps, ...) are refused by
name. A method DeepSpeed has and zerodp does not (op builders, graphs, ...) raises one line naming it.
Each device's torch calls go through `self.torch_module` (torch.cuda, or a stand-in in the unit tests),
so the CUDA answers are tested on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

__all__ = ["Accelerator", "get_accelerator", "set_accelerator"]

_NOT_PROVIDED = ("create_op_builder", "get_op_builder", "op_builder_dir", "build_extension", "create_graph",
                 "capture_to_graph", "replay_graph", "register_host_memory", "unregister_host_memory")


class Accelerator:
    """DeepSpeed's accelerator interface for one device kind ('cpu' or 'cuda')."""

    def __init__(self, name: str, torch_module=None) -> None:
        if name not in ("cpu", "cuda"):
            raise ValueError(f"accelerator {name!r} is not supported by zerodp; it runs on 'cpu' and 'cuda' (set "
                             f"DS_ACCELERATOR to one of them or unset it)")
        self._name = name
        self._communication_backend_name = "gloo" if name == "cpu" else "nccl"
        self.torch_module = torch_module if torch_module is not None else (torch.cuda if name == "cuda" else None)
        self._max_rss = 0

    def __getattr__(self, attr: str):
        if attr in _NOT_PROVIDED:
            raise NotImplementedError(f"get_accelerator().{attr} (DeepSpeed's custom kernels and graphs) is not "
                                      f"provided by zerodp, which runs on torch's own kernels")
        raise AttributeError(f"get_accelerator() has no attribute {attr!r} (zerodp implements the subset "
                             f"listed in zerodp/adapters/deepspeed/accelerator.py)")

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"

    # --- device ---
    def device_name(self, device_index: Optional[int] = None) -> str:
        if self._name == "cpu" or device_index is None:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: Optional[int] = None):
        return None if self._name == "cpu" else self.torch_module.device(device_index)

    def current_device(self) -> int:
        return 0 if self._name == "cpu" else self.torch_module.current_device()

    def current_device_name(self) -> str:
        return "cpu" if self._name == "cpu" else f"cuda:{self.torch_module.current_device()}"

    def set_device(self, device_index) -> None:
        if self._name == "cuda":
            self.torch_module.set_device(device_index)

    def device_count(self) -> int:
        if self._name == "cpu":
            local_size = int(os.environ.get("LOCAL_SIZE", 0))
            return local_size if local_size > 0 else 1
        return self.torch_module.device_count()

    def is_available(self) -> bool:
        return True if self._name == "cpu" else self.torch_module.is_available()

    def synchronize(self, device_index=None) -> None:
        if self._name == "cuda":
            self.torch_module.synchronize(device_index)

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    # --- RNG ---
    def manual_seed(self, seed: int):
        return torch.manual_seed(seed) if self._name == "cpu" else self.torch_module.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        return torch.manual_seed(seed) if self._name == "cpu" else self.torch_module.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed() if self._name == "cpu" else self.torch_module.initial_seed()

    def get_rng_state(self, device_index=None):
        if self._name == "cpu":
            return torch.get_rng_state()
        return self.torch_module.get_rng_state() if device_index is None else \
            self.torch_module.get_rng_state(device_index)

    def set_rng_state(self, new_state, device_index=None):
        if self._name == "cpu":
            return torch.set_rng_state(new_state)
        return self.torch_module.set_rng_state(new_state) if device_index is None else \
            self.torch_module.set_rng_state(new_state, device_index)

    # --- streams and events ---
    @property
    def Stream(self):  # noqa: N802 (DeepSpeed's name)
        return None if self._name == "cpu" else self.torch_module.Stream

    @property
    def Event(self):  # noqa: N802 (DeepSpeed's name)
        return None if self._name == "cpu" else self.torch_module.Event

    def stream(self, stream):
        return contextlib.nullcontext() if self._name == "cpu" else self.torch_module.stream(stream)

    def current_stream(self, device_index=None):
        return None if self._name == "cpu" else self.torch_module.current_stream(device_index)

    def default_stream(self, device_index=None):
        return None if self._name == "cpu" else self.torch_module.default_stream(device_index)

    # --- memory ---
    def _rss(self) -> int:
        import psutil

        rss = psutil.Process().memory_info().rss
        self._max_rss = max(self._max_rss, rss)
        return rss

    def _cuda_or_rss(self, name: str, device_index, peak: bool = False) -> int:
        if self._name == "cuda":
            return getattr(self.torch_module, name)(device_index)
        rss = self._rss()
        return self._max_rss if peak else rss

    def memory_allocated(self, device_index=None) -> int:
        return self._cuda_or_rss("memory_allocated", device_index)

    def max_memory_allocated(self, device_index=None) -> int:
        return self._cuda_or_rss("max_memory_allocated", device_index, peak=True)

    def memory_reserved(self, device_index=None) -> int:
        return self._cuda_or_rss("memory_reserved", device_index)

    def max_memory_reserved(self, device_index=None) -> int:
        return self._cuda_or_rss("max_memory_reserved", device_index, peak=True)

    def memory_cached(self, device_index=None) -> int:
        return self._cuda_or_rss("memory_reserved", device_index)

    def max_memory_cached(self, device_index=None) -> int:
        return self._cuda_or_rss("max_memory_reserved", device_index, peak=True)

    def reset_peak_memory_stats(self, device_index=None) -> None:
        if self._name == "cuda":
            self.torch_module.reset_peak_memory_stats(device_index)
        else:
            self._max_rss = 0
            self._rss()

    reset_max_memory_allocated = reset_peak_memory_stats
    reset_max_memory_cached = reset_peak_memory_stats

    def empty_cache(self) -> None:
        if self._name == "cuda":
            self.torch_module.empty_cache()

    def memory_stats(self, device_index=None) -> dict:
        if self._name == "cuda":
            return self.torch_module.memory_stats(device_index)
        rss = self._rss()
        return {"allocated_bytes.all.current": rss, "allocated_bytes.all.peak": self._max_rss}

    def total_memory(self, device_index=None) -> int:
        if self._name == "cuda":
            return self.torch_module.get_device_properties(device_index).total_memory
        import psutil

        return psutil.virtual_memory().total

    def available_memory(self, device_index=None) -> int:
        if self._name == "cuda":
            return self.total_memory(device_index) - self.memory_allocated(device_index)
        import psutil

        return psutil.virtual_memory().available

    # --- data types ---
    def is_bf16_supported(self) -> bool:
        if self._name == "cpu" or not self.torch_module.is_available():
            return True
        return self.torch_module.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        if self._name == "cpu":
            try:
                return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
            except Exception:  # older torch builds lack the query: DeepSpeed answers False then too
                return False
        if not self.torch_module.is_available():
            return True
        major, _ = self.torch_module.get_device_capability()
        # DeepSpeed: compute capability 6.x only with DS_ALLOW_DEPRECATED_FP16=1
        return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1")

    def supported_dtypes(self) -> list:
        dtypes = [torch.float]
        if self.is_fp16_supported():
            dtypes.append(torch.half)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    # --- tensors ---
    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        prefix = "cpu" if self._name == "cpu" else "cuda:"
        return str(tensor.device).startswith(prefix)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        # torch pins host memory only for a GPU; DeepSpeed's CPU accelerator returns the tensor unchanged
        return tensor if self._name == "cpu" else tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False if self._name == "cpu" else tensor.is_pinned()

    # --- profiling ranges and misc ---
    def range_push(self, msg: str, *args, **kwargs) -> None:
        if self._name == "cuda":
            self.torch_module.nvtx.range_push(msg)

    def range_pop(self, *args, **kwargs) -> None:
        if self._name == "cuda":
            self.torch_module.nvtx.range_pop()

    def lazy_call(self, callback):
        return callback() if self._name == "cpu" else self.torch_module._lazy_call(callback)

    def is_triton_supported(self) -> bool:
        return False if self._name == "cpu" else self.torch_module.is_available()

    def get_compile_backend(self) -> str:
        return "inductor"


# DeepSpeed's get_accelerator()/set_accelerator() name one accelerator per process, by DeepSpeed's API: a module
# global on purpose (made on first call). It describes the device, holds no training state, and the adapter sits
# above the engine's Runtime, which never sees it.
_ACCELERATOR: Optional[Accelerator] = None


def _detect() -> str:
    chosen = os.environ.get("DS_ACCELERATOR")
    if chosen:
        return chosen  # Accelerator() refuses anything but cpu and cuda, naming the value
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_accelerator() -> Accelerator:
    """The process's accelerator (made on first call; `set_accelerator` replaces it)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator(_detect())
    return _ACCELERATOR


def set_accelerator(accelerator: Accelerator) -> None:
    """Replace the process's accelerator (DeepSpeed's `set_accelerator`)."""
    global _ACCELERATOR
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"set_accelerator needs a zerodp.deepspeed.accelerator.Accelerator, got "
                        f"{type(accelerator).__name__}")
    _ACCELERATOR = accelerator
