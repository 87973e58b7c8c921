"""Block-wise quantization (comm/quantize.py), the arithmetic of qwZ/qgZ: the error bound per element,
exact round trips of representable values, payload sizes, zeros and padding."""

import pytest
import torch

from zerodp.comm.quantize import dequantize, payload_numel, quantize


@pytest.mark.parametrize("bits,qmax", [(8, 127), (4, 7)])
@pytest.mark.parametrize("numel", [1, 63, 64, 1000])
def test_error_is_within_half_a_step_of_each_block(bits, qmax, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * torch.logspace(-3, 1, numel)
    block = 64
    payload = quantize(x, bits, block)
    assert payload.dtype == torch.uint8 and payload.numel() == payload_numel(numel, bits, block)
    y = dequantize(payload, numel, bits, block)
    for lo in range(0, numel, block):
        xb, yb = x[lo:lo + block], y[lo:lo + block]
        bound = xb.abs().max() / (2 * qmax) * (1 + 1e-6)
        assert (xb - yb).abs().max() <= bound


@pytest.mark.parametrize("bits", [4, 8])
def test_representable_values_round_trip_exactly_and_zeros_stay_zero(bits):
    qmax = 2 ** (bits - 1) - 1
    ints = torch.arange(-qmax, qmax + 1, dtype=torch.float32)
    x = torch.cat([ints * 0.5, torch.zeros(2 * qmax + 1)])  # block 1: scale 0.5; block 2: all zero
    y = dequantize(quantize(x, bits, 2 * qmax + 1 + (bits == 4)), x.numel(), bits, 2 * qmax + 1 + (bits == 4))
    assert torch.equal(y, x)


def test_payload_is_a_quarter_of_fp32_for_int8_and_an_eighth_for_int4():
    assert payload_numel(4096, 8, 256) == 4096 + 4 * 16
    assert payload_numel(4096, 4, 256) == 2048 + 4 * 16


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="3 bits is not supported"):
        quantize(torch.ones(4), 3, 4)
    with pytest.raises(ValueError, match="block_numel must be even"):
        quantize(torch.ones(4), 4, 3)
    with pytest.raises(ValueError, match="does not hold"):
        dequantize(torch.zeros(5, dtype=torch.uint8), 8, 8, 4)
