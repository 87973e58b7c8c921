"""Block-wise symmetric quantization: the arithmetic of ZeRO++'s quantized collectives (qwZ, qgZ).

A flat tensor is cut into blocks of `block_numel` consecutive elements (the last one zero-padded).
Each block b keeps one fp32 scale s_b = max|x_b| / qmax and integers q = round(x / s_b), clamped to
[-qmax, qmax], with qmax = 2^(bits-1) - 1: 127 for int8 (qwZ's weights), 7 for int4 (qgZ's
gradients, two values packed per byte). Dequantized, every element is within s_b / 2 of its value:

    |x - q s_b| <= max|x_b| / (2 qmax)      (int8: 0.39% of the block's largest magnitude; int4: 7.1%)

A quantized tensor travels as one uint8 payload: the packed integers, then the scales' bytes, so one
collective moves both. Per element: 1 byte + 4 / block_numel (int8) or 0.5 + 4 / block_numel (int4),
against 4 (fp32) or 2 (bf16). Pure tensor arithmetic, no process group: unit-tested alone.
"""

from __future__ import annotations

import torch

BITS = (4, 8)


def _qmax(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"quantization to {bits} bits is not supported; use one of {BITS}")
    return 2 ** (bits - 1) - 1


def num_blocks(numel: int, block_numel: int) -> int:
    return -(-numel // block_numel)


def payload_numel(numel: int, bits: int, block_numel: int) -> int:
    """Bytes of the uint8 payload that carries `numel` elements quantized to `bits`."""
    blocks = num_blocks(numel, block_numel)
    return blocks * block_numel * bits // 8 + 4 * blocks


def quantize(x: torch.Tensor, bits: int, block_numel: int) -> torch.Tensor:
    """The uint8 payload of flat `x` (any float dtype): packed integers, then fp32 block scales."""
    qmax = _qmax(bits)
    if bits == 4 and block_numel % 2:
        raise ValueError(f"int4 blocks pack two values per byte: block_numel must be even, got {block_numel}")
    flat = x.detach().reshape(-1).float()
    blocks = num_blocks(flat.numel(), block_numel)
    padded = torch.zeros(blocks * block_numel, dtype=torch.float32, device=flat.device)
    padded[:flat.numel()] = flat
    padded = padded.view(blocks, block_numel)
    scales = padded.abs().amax(dim=1) / qmax
    # an all-zero block keeps scale 0 and integers 0 (dividing by 1 instead avoids 0/0)
    q = torch.round(padded / torch.where(scales > 0, scales, 1.0).unsqueeze(1)).clamp_(-qmax, qmax)
    if bits == 8:
        ints = q.to(torch.int8).view(torch.uint8).reshape(-1)
    else:  # two's-complement nibbles, low nibble first
        nibbles = q.to(torch.int16).bitwise_and_(0xF).to(torch.uint8).reshape(-1, 2)
        ints = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return torch.cat([ints, scales.view(torch.uint8)])


def dequantize(payload: torch.Tensor, numel: int, bits: int, block_numel: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The `numel` values of a `quantize` payload, as `dtype`."""
    _qmax(bits)
    blocks = num_blocks(numel, block_numel)
    int_bytes = blocks * block_numel * bits // 8
    if payload.numel() != int_bytes + 4 * blocks:
        raise ValueError(f"payload of {payload.numel()} bytes does not hold {numel} elements at {bits} bits")
    scales = payload[int_bytes:].clone().view(torch.float32)  # clone: the slice may be unaligned for a view
    raw = payload[:int_bytes]
    if bits == 8:
        q = raw.view(torch.int8).float()
    else:
        low, high = raw.bitwise_and(0xF).to(torch.int16), raw.bitwise_right_shift(4).to(torch.int16)
        nibbles = torch.stack([low, high], dim=1).reshape(-1)
        q = torch.where(nibbles > 7, nibbles - 16, nibbles).float()  # sign-extend the nibble
    values = q.view(blocks, block_numel) * scales.unsqueeze(1)
    return values.reshape(-1)[:numel].to(dtype)
