"""Reading a safetensors file by element ranges with plain reads: `TensorFileReader`.

Why not `safetensors.safe_open`: it maps the whole file, and every page a slice touches stays in the
process's RSS (file-backed, but resident and counted) until the mapping closes. A load reads most of
a rank's file, so a fresh process resuming from a 576 MiB rank file gained ~0.57 GiB of peak RSS
from the mapping alone (bench/checkpoint_rss.py), whatever it held. Here each slice is read with
pread into a fresh tensor, which is the only memory it costs; the page cache is the kernel's.

The format (as format.write_tensor_file writes it, and as any safetensors writer does): an 8-byte
little-endian header length, a JSON header {key: {dtype, shape, data_offsets: [begin, end)}} with
offsets relative to the end of the header, then the data.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from pathlib import Path

import torch

from ..errors import CheckpointError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class TensorFileReader:
    """Element ranges of the tensors of one safetensors file, each read on demand (no mapping)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "rb")  # closed with this object, or by close()
        try:
            head = os.pread(self._file.fileno(), 8, 0)
            (length,) = struct.unpack("<Q", head)
            self.header = json.loads(os.pread(self._file.fileno(), length, 8))
        except (struct.error, ValueError, UnicodeDecodeError) as err:
            self._file.close()
            raise CheckpointError(f"{self.path} is not a readable safetensors file ({err})") from None
        self.data_start = 8 + length

    def _entry(self, key: str) -> tuple[torch.dtype, list[int], int]:
        entry = self.header.get(key)
        if entry is None or key == "__metadata__":
            raise CheckpointError(f"{self.path} has no tensor {key!r}; the checkpoint's metadata and files disagree")
        if entry["dtype"] not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {key!r} has dtype {entry['dtype']}, which zerodp does not read")
        return DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"][0]

    def read(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of tensor `key`, flattened, in a new 1-D tensor."""
        dtype, shape, begin = self._entry(key)
        numel = torch.Size(shape).numel()
        if not 0 <= lo <= hi <= numel:
            raise CheckpointError(f"{self.path}: elements [{lo}, {hi}) of {key!r} requested, but it has {numel}")
        out = torch.empty(hi - lo, dtype=dtype)
        nbytes = out.numel() * out.element_size()
        if nbytes:
            view = memoryview((ctypes.c_char * nbytes).from_address(out.data_ptr())).cast("B")
            offset, done = self.data_start + begin + lo * out.element_size(), 0
            while done < nbytes:  # pread may return less than asked (large reads, signals)
                got = os.preadv(self._file.fileno(), [view[done:]], offset + done)
                if got == 0:
                    raise CheckpointError(f"{self.path} ends inside tensor {key!r}; the file is truncated")
                done += got
        return out

    def get_tensor(self, key: str) -> torch.Tensor:
        """Tensor `key` whole, in its saved shape."""
        _, shape, _ = self._entry(key)
        return self.read(key, 0, torch.Size(shape).numel()).view(shape)

    def close(self) -> None:
        self._file.close()
