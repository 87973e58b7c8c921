"""Configuration of the offload tier: DeepSpeed's `offload_optimizer`, `offload_param` and `aio` sections.

The keys and their meanings are DeepSpeed's, so existing ZeRO-Offload / ZeRO-Infinity configs load
unchanged. What zerodp honours is honoured; the few keys that cannot change anything here are
accepted and reported once (`ignored_settings`), never silently dropped. Checks that need the model
(free disk space for the predicted bytes, a writable `nvme_path`) run when the engine is built, before
any work: see `offload.checks`.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

from pydantic import Field, model_validator

from .strict import StrictModel


# zero_optimization.sub_group_size when a config leaves it unset: windows of 16 MiB per fp32 state tensor.
# DeepSpeed's 1e9 streams a rank's whole optimizer state at once (12 GB of fp32 Adam state at 1e9 elements);
# at 4e6 the window's fixed costs (one read and one write per state tensor, a few ms) stay small beside its
# I/O (16 MiB at ~1 GB/s), and 201M parameters on 2 ranks train at 0.27 GiB of peak RSS growth with it.
DEFAULT_SUB_GROUP_SIZE = 4_000_000


class OffloadDevice(str, Enum):
    """Where offloaded tensors live: `none` (off), `cpu` (host memory) or `nvme` (files under nvme_path)."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"

    def __repr__(self) -> str:  # the config reference shows 'none', as a user writes it
        return repr(self.value)


def _check_nvme_path(device: OffloadDevice, nvme_path: Optional[str], section: str) -> None:
    if device is OffloadDevice.NVME and not nvme_path:
        raise ValueError(f"{section}.device is 'nvme' but {section}.nvme_path is not set; set it to a directory on "
                         f"a fast local disk (zerodp creates its files under it)")


class OffloadOptimizerConfig(StrictModel):
    """`zero_optimization.offload_optimizer` (stages 1-3): where the fp32 master shard's optimizer state lives."""

    device: OffloadDevice = Field(OffloadDevice.NONE, description="none: off; cpu: optimizer state in host "
                                  "memory (without a GPU this is the same memory as no offload); nvme: in files "
                                  "under nvme_path, streamed through the step in sub_group_size chunks.")
    nvme_path: Optional[str] = Field(None, description="Directory for the files of device 'nvme'; zerodp "
                                     "creates nvme_path/zerodp-<run id>/rank<r>/ and removes it on exit.")
    pin_memory: bool = Field(False, description="Page-lock the I/O buffers (only with a CUDA device; no effect "
                             "on a CPU-only machine).")
    buffer_count: int = Field(4, ge=1, description="I/O buffers of sub_group_size elements per state tensor: "
                              "3 overlap the read of chunk i+1, the step of chunk i and the write of chunk i-1.")
    pipeline_read: bool = Field(False, description="DeepSpeed's switch for overlapping reads; zerodp always "
                                "overlaps (no effect).")
    pipeline_write: bool = Field(False, description="DeepSpeed's switch for overlapping writes; zerodp always "
                                 "overlaps (no effect).")
    fast_init: bool = Field(False, description="DeepSpeed's faster start for nvme; zerodp never writes "
                            "state before the first step (no effect).")
    ratio: float = Field(1.0, gt=0.0, le=1.0, description="Fraction of the optimizer state to offload; "
                         "the first (1 - ratio) of each rank's shard stays in host memory.")

    @model_validator(mode="after")
    def _check(self) -> "OffloadOptimizerConfig":
        _check_nvme_path(self.device, self.nvme_path, "offload_optimizer")
        return self

    @property
    def enabled(self) -> bool:
        return self.device is not OffloadDevice.NONE


class OffloadParamConfig(StrictModel):
    """`zero_optimization.offload_param` (stage 3 only): where the partitioned parameter shards live."""

    device: OffloadDevice = Field(OffloadDevice.NONE, description="none: off; cpu: parameter shards in host "
                                  "memory (same memory as no offload without a GPU); nvme: in files under "
                                  "nvme_path, read ahead of use in the stage-3 prefetch order (in fp32 the "
                                  "gradient shards too).")
    nvme_path: Optional[str] = Field(None, description="Directory for the files of device 'nvme'.")
    pin_memory: bool = Field(False, description="Page-lock the I/O buffers (only with a CUDA device).")
    buffer_count: int = Field(5, ge=1, description="Parameter shards that can be in flight (read or written) "
                              "at once.")
    buffer_size: int = Field(100_000_000, ge=1, description="Elements of one I/O buffer; must hold the "
                             "largest parameter shard.")
    max_in_cpu: Optional[int] = Field(None, ge=0, description="Most parameter-shard elements cached in host "
                                      "memory at once (nvme); in fp32, as many gradient-shard elements besides. "
                                      "Unset: the working set only, buffer_count x the largest shard (logged at "
                                      "start-up): DeepSpeed's default, 1e9, caches a rank's whole shard up to 4 GB "
                                      "in fp32, which is the memory offload was asked to free. Write a number to "
                                      "cache more (fewer reads).")

    @model_validator(mode="after")
    def _check(self) -> "OffloadParamConfig":
        _check_nvme_path(self.device, self.nvme_path, "offload_param")
        return self

    @property
    def enabled(self) -> bool:
        return self.device is not OffloadDevice.NONE


class AioConfig(StrictModel):
    """DeepSpeed's `aio` section: how NVMe files are read and written."""

    block_size: int = Field(1_048_576, ge=512, description="Bytes per I/O request: a request larger than this "
                            "is split into block_size pieces issued in parallel.")
    queue_depth: int = Field(8, ge=1, description="Most I/O requests in flight per thread: zerodp runs "
                             "thread_count x queue_depth blocking reads/writes at once.")
    intra_op_parallelism: Optional[int] = Field(None, ge=1, description="I/O threads (newer DeepSpeed name "
                                                "of thread_count).")
    thread_count: int = Field(1, ge=1, description="I/O threads (older DeepSpeed name); the larger of the two "
                              "counts is used, times queue_depth.")
    single_submit: bool = Field(False, description="libaio submission mode; zerodp uses a thread pool of "
                                "pread/pwrite (no effect).")
    overlap_events: bool = Field(True, description="libaio event overlap; the thread pool always overlaps "
                                 "(no effect).")
    use_gds: bool = Field(False, description="NVIDIA GPUDirect Storage; not available in zerodp (no effect: "
                          "data always passes through host memory).")

    @model_validator(mode="after")
    def _check(self) -> "AioConfig":
        if self.block_size % 512:
            raise ValueError(f"aio.block_size={self.block_size} is not a multiple of 512 bytes (a disk sector); "
                             f"use a power of two such as 1048576")
        return self

    @property
    def io_requests(self) -> int:
        """Requests in flight at once, DeepSpeed's threads x queue depth; zerodp gives each its own pool
        thread doing a blocking pread/pwrite ([Note: offload I/O] in offload/file_io.py)."""
        return max(self.thread_count, self.intra_op_parallelism or 1) * self.queue_depth


def ignored_settings(optimizer: OffloadOptimizerConfig, param: OffloadParamConfig, aio: AioConfig,
                     has_cuda: bool) -> list[str]:
    """Keys set in the config that cannot change anything on this machine (reported once by the engine)."""
    out = []
    for name, section in (("offload_optimizer", optimizer), ("offload_param", param)):
        if not section.enabled:
            continue
        if section.device is OffloadDevice.CPU and not has_cuda:
            out.append(f"{name}.device=cpu: without a GPU host memory is the only memory; this runs the offload "
                       f"code path with the same memory as no offload")
        if section.pin_memory and not has_cuda:
            out.append(f"{name}.pin_memory: no CUDA device, nothing to pin for")
    for key in ("pipeline_read", "pipeline_write", "fast_init"):
        if optimizer.enabled and key in optimizer.model_fields_set:
            out.append(f"offload_optimizer.{key}: no effect (zerodp always overlaps I/O and initialises lazily)")
    for key in ("single_submit", "overlap_events", "use_gds"):
        if key in aio.model_fields_set:
            out.append(f"aio.{key}: no effect (zerodp uses a thread pool of pread/pwrite)")
    return out


def check_stage(stage: int, optimizer: OffloadOptimizerConfig, param: OffloadParamConfig) -> None:
    """offload_param needs stage 3 (only stage 3 partitions parameters); offload_optimizer needs stage 1+."""
    if param.enabled and stage != 3:
        raise ValueError(f"offload_param needs stage 3 (only stage 3 partitions parameters), but stage is {stage}; "
                         f"set zero_optimization.stage to 3 or remove offload_param")
    if optimizer.enabled and stage == 0:
        raise ValueError("offload_optimizer needs stage 1, 2 or 3 (stage 0 does not shard the optimizer state); "
                         "set zero_optimization.stage to at least 1 or remove offload_optimizer")
