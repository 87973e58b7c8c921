"""The gradient arithmetic keys without a process group: the config accepts DeepSpeed's values and
spellings and refuses the rest with one message; `GradShard` applies `GradArithmetic` exactly, checked
at 3 "ranks" (a fake reduction adds two other ranks' buffers), where dividing before or after the sum
and reducing in fp32 or bf16 give different bits (at 2 ranks they may not: tests/dist/test_grad_dtypes.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerodp import comm
from zerodp.config import ConfigError, load_config
from zerodp.shard.grads.grad_arithmetic import GradArithmetic
from zerodp.shard.grads.grad_shard import GradShard
from zerodp.shard.flat.layout import FlatLayout
from zerodp.precision.policy import PrecisionPolicy

# -- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize("written,read", [("fp32", "fp32"), ("FP32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16")])
def test_communication_data_type_values(written, read):
    cfg = load_config({"bf16": {"enabled": True}, "communication_data_type": written})
    assert cfg.communication_data_type == read
    assert PrecisionPolicy.from_config(cfg).reduce_dtype == {"fp32": torch.float32, "bf16": torch.bfloat16,
                                                            "fp16": torch.float16}[read]


@pytest.mark.parametrize("written,read", [("fp32", "fp32"), ("float32", "fp32"), ("float", "fp32"),
                                          ("torch.float32", "fp32"), ("bfloat16", "bf16"), ("half", "fp16")])
def test_grad_accum_dtype_takes_deepspeeds_spellings(written, read):
    cfg = load_config({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
                       "data_types": {"grad_accum_dtype": written}})
    assert cfg.data_types.grad_accum_dtype == read


def test_defaults_are_deepspeeds():
    cfg = load_config({"fp16": {"enabled": True}})
    policy = PrecisionPolicy.from_config(cfg)
    assert (policy.reduce_dtype, policy.grad_accum_dtype) == (None, None)  # None: the compute dtype
    assert (cfg.prescale_gradients, cfg.gradient_predivide_factor) == (False, 1.0)
    assert not cfg._notes  # nothing about these keys is "accepted with no effect" any more


@pytest.mark.parametrize("config,fragment", [
    ({"communication_data_type": "int8"}, "communication_data_type='int8' is not a dtype"),
    ({"communication_data_type": "float32"}, "write 'fp32', 'bf16' or 'fp16'"),  # DeepSpeed: fp32/fp16/bf16 only
    ({"data_types": {"grad_accum_dtype": "int8"}}, "grad_accum_dtype='int8' is not a dtype"),
    ({"data_types": {"grad_accum_dtype": 32}}, "grad_accum_dtype=32 is not a dtype"),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, "needs ZeRO stage 1-3"),
    ({"data_types": {"grad_acum_dtype": "fp32"}}, "did you mean 'grad_accum_dtype'"),
    ({"gradient_predivide_factor": 0}, "gradient_predivide_factor"),
    ({"gradient_predivide_factor": -2.0}, "greater than 0"),
    ({"prescale_gradients": "sometimes"}, "prescale_gradients"),
    ({"bf16": {"enabled": True}, "communication_data_type": "fp32",
      "zero_optimization": {"stage": 3, "zero_quantized_gradients": True}}, "quantized reduction sends int4"),
])
def test_bad_values_are_refused_with_one_message(config, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    message = str(err.value)
    assert fragment in message
    assert message.count("\n  ") == 1, f"one problem, one line: {message}"


def test_stage_0_accepts_the_compute_dtype():
    cfg = load_config({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}})
    assert cfg.data_types.grad_accum_dtype == "bf16"


def test_predivide_with_prescale_warns_that_it_is_ignored():
    with pytest.warns(UserWarning, match="gradient_predivide_factor=4.0 has no effect with prescale_gradients"):
        load_config({"prescale_gradients": True, "gradient_predivide_factor": 4.0})


# -- arithmetic ---------------------------------------------------------------------------------


def test_divisors():
    assert (GradArithmetic(8).pre_divisor, GradArithmetic(8).post_divisor) == (1.0, 8.0)
    assert (GradArithmetic(8, predivide=2.0).pre_divisor, GradArithmetic(8, predivide=2.0).post_divisor) == (2.0, 4.0)
    prescaled = GradArithmetic(8, predivide=2.0, prescale=True)  # predivide ignored, as in DeepSpeed
    assert (prescaled.pre_divisor, prescaled.post_divisor) == (8.0, 1.0)
    with pytest.raises(ValueError, match="positive"):
        GradArithmetic(2, predivide=0.0)


OTHERS = [torch.tensor([0.3, 1.7, -2.9, 5.1, 0.011]), torch.tensor([1.1, -0.7, 2.3, -5.3, 0.023])]


def _three_rank_shard(arithmetic: GradArithmetic, keep_full: bool):
    """A GradShard whose reduction adds two fixed "other ranks'" buffers, each sent as this rank's is
    (in the buffer's dtype, divided by the same pre-divisor), in rank order."""
    params = [nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)), nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
    layout = FlatLayout.of([p.shape for p in params], 1)

    def reduce(output, full, async_op):
        others = [o.to(torch.bfloat16).to(full.dtype) for o in OTHERS]
        if arithmetic.pre_divisor != 1.0:
            others = [o / arithmetic.pre_divisor for o in others]
        full.copy_((full + others[0]) + others[1])
        return comm.Handle()

    return GradShard(params, layout, 0, arithmetic, reduce, keep_full=keep_full), params


def _expected(mine: torch.Tensor, comm_dtype, pre: float, post: float) -> torch.Tensor:
    """The module docstring of grads/grad_arithmetic.py, written out: cast, divide, sum in rank order, divide."""
    sends = [t.to(torch.bfloat16).to(comm_dtype) for t in (mine, *OTHERS)]
    sends = [s / pre if pre != 1.0 else s for s in sends]
    total = (sends[0] + sends[1]) + sends[2]
    return (total / post if post != 1.0 else total).to(torch.bfloat16)


@pytest.mark.parametrize("keep_full", [True, False])
@pytest.mark.parametrize("keys", [{}, {"comm_dtype": torch.float32}, {"prescale": True}, {"predivide": 3.0},
                                  {"comm_dtype": torch.float32, "predivide": 1.5}])
def test_grad_shard_applies_the_arithmetic_exactly(keep_full, keys):
    arithmetic = GradArithmetic(3, **keys)
    shard, params = _three_rank_shard(arithmetic, keep_full)
    mine = torch.tensor([2.7, -1.3, 0.9, 4.4, 0.017])
    params[0].grad, params[1].grad = mine[:3].to(torch.bfloat16), mine[3:].to(torch.bfloat16)
    shard.add_grad(0)
    shard.add_grad(1)
    shard.launch()
    shard.wait()
    expected = _expected(mine, keys.get("comm_dtype", torch.bfloat16), arithmetic.pre_divisor,
                         arithmetic.post_divisor)
    assert shard.shard.dtype == torch.bfloat16
    assert torch.equal(shard.shard, expected), (shard.shard, expected)
    if keys:  # at 3 ranks each key changes the bits: the test would catch a key that is ignored
        assert not torch.equal(expected, _expected(mine, torch.bfloat16, 1.0, 3.0))


@pytest.mark.parametrize("keep_full", [True, False])
def test_fp32_accumulation_keeps_the_bits_bf16_drops(keep_full):
    """Three micro-steps of bf16 gradients: fp32 accumulation (stages 0-1: before the reduction; 2-3:
    of the reduced slices) keeps what a bf16 running sum rounds away."""
    steps = [torch.tensor([1.0, 256.0]), torch.tensor([1 / 256, 1.0]), torch.tensor([1 / 256, 1.0])]
    results = {}
    for accum in (torch.bfloat16, torch.float32):
        params = [nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
        layout = FlatLayout.of([(2,)], 1)
        shard = GradShard(params, layout, 0, GradArithmetic(1, accum_dtype=accum, comm_dtype=accum),
                          lambda output, full, async_op: comm.Handle(), keep_full=keep_full)
        for g in steps:
            shard.start_micro_step()
            params[0].grad = g.to(torch.bfloat16)
            shard.add_grad(0)
            if not keep_full:  # stages 2-3 reduce every micro-step
                shard.launch()
                shard.wait()
        if keep_full:
            shard.launch()
            shard.wait()
        assert shard.shard.dtype == accum
        results[accum] = shard.shard.clone()
    assert torch.equal(results[torch.float32], torch.tensor([1 + 2 / 256, 258.0]))
    # bf16 keeps 8 significant bits: 1 + 1/256 and 256 + 1 are ties that round to even, every time
    assert torch.equal(results[torch.bfloat16].float(), torch.tensor([1.0, 256.0]))
