"""The precision sections of the config: `fp16`, `bf16`, and the gradient dtypes (`data_types`), with
DeepSpeed's spellings of a dtype. The top-level `communication_data_type` is a field of `ZeroConfig`
(schema.py) that uses the same names; `zerodp.precision.policy.PrecisionPolicy` turns them into torch dtypes.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from .strict import StrictModel


class FP16Config(StrictModel):
    """fp16 mixed precision with (by default dynamic) loss scaling, as DeepSpeed's `fp16` section."""

    enabled: bool = Field(False, description="Compute in fp16 with fp32 master weights.")
    loss_scale: float = Field(0.0, ge=0, description="Static loss scale; 0 selects dynamic loss scaling.")
    initial_scale_power: int = Field(16, ge=0, le=63, description="Dynamic scaling starts at 2**initial_scale_power.")
    loss_scale_window: int = Field(1000, ge=1, description="Clean steps before the dynamic scale doubles.")
    hysteresis: int = Field(2, ge=1, description="Overflows tolerated before the scale is lowered.")
    consecutive_hysteresis: bool = Field(False, description="Refill the hysteresis budget after every clean step.")
    min_loss_scale: float = Field(1.0, gt=0, description="The dynamic scale never goes below this value.")


class BF16Config(StrictModel):
    """bf16 mixed precision (no loss scaling needed), as DeepSpeed's `bf16` section."""

    enabled: bool = Field(False, description="Compute in bf16 with fp32 master weights.")


# DeepSpeed's dtype names (its DtypeEnum: data_types.grad_accum_dtype) -> zerodp's canonical name.
DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
               "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
               "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16"}
GradDtype = Literal["fp32", "fp16", "bf16"]


def dtype_name(value: Any, key: str, names: dict) -> Any:
    """DeepSpeed's spelling of a dtype (case-insensitive) as "fp32"/"fp16"/"bf16"; anything else is refused."""
    if value is None:
        return None
    canonical = names.get(str(value).lower()) if isinstance(value, str) else None
    if canonical is None:
        raise ValueError(f"{key}={value!r} is not a dtype zerodp reduces or accumulates gradients in; write "
                         f"'fp32', 'bf16' or 'fp16' (or remove the key: the compute dtype)")
    return canonical


class TorchAutocastConfig(StrictModel):
    """DeepSpeed's `torch_autocast` section (DeepSpeed >= 0.17): torch.autocast mixed precision. The parameters,
    master weights and optimizer states stay fp32; the engine's forward runs under `torch.autocast(dtype)`, and
    the gradients of the lower-precision-safe modules' parameters are summed over ranks in `dtype` (the others
    in fp32). zerodp.precision.autocast holds the mechanism and the differences from DeepSpeed."""

    enabled: bool = Field(False, description="Run the engine's forward under torch.autocast (no torch.autocast "
                          "call needed in the training script).")
    dtype: GradDtype = Field("bf16", description="The autocast dtype, also the dtype the lower-precision-safe "
                             "modules' gradients are summed over ranks in. DeepSpeed's spellings ('bfloat16', "
                             "'torch.bfloat16', ...). zerodp runs bf16 only: fp16 autocast needs torch's "
                             "GradScaler, which zerodp does not drive.")
    lower_precision_safe_modules: Optional[list[str]] = Field(None, description="Dotted class names (e.g. "
        "'torch.nn.Linear') whose own parameters' gradients are reduced in `dtype`; exact classes, not subclasses, "
        "as DeepSpeed. Unset: torch.nn.Linear, Conv1d, Conv2d, Conv3d.")

    @model_validator(mode="before")
    @classmethod
    def _canonical(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("dtype") is not None:
            data = {**data, "dtype": dtype_name(data["dtype"], "torch_autocast.dtype", DTYPE_NAMES)}
        return data

    @model_validator(mode="after")
    def _bf16_only(self) -> "TorchAutocastConfig":
        if self.enabled and self.dtype != "bf16":
            fix = ("fp16 autocast needs torch.amp.GradScaler's loss scaling, which zerodp does not drive; use dtype "
                   "'bfloat16', or the fp16 section (fp16 parameters with zerodp's loss scaler)") \
                if self.dtype == "fp16" else "autocast to fp32 computes nothing in lower precision; use 'bfloat16'"
            raise ValueError(f"torch_autocast.dtype={self.dtype!r}: {fix}")
        return self

    def check_compatible(self, compute: str, zero: Any) -> None:
        """Refuse what cannot run with autocast: a 16-bit model, the quantized collectives."""
        if self.enabled and compute != "fp32":
            raise ValueError(f"torch_autocast.enabled with {compute}.enabled: the {compute} section casts the "
                             f"parameters to {compute}, torch_autocast keeps them fp32 and autocasts the forward; "
                             f"enable one of the two")
        if self.enabled and (zero.zero_quantized_weights or zero.zero_quantized_gradients):
            raise ValueError("torch_autocast with zero_quantized_weights/zero_quantized_gradients: the quantized "
                             "collectives send int8/int4, not the autocast dtype (DeepSpeed refuses the weights "
                             "too); remove one of them")


class DataTypesConfig(StrictModel):
    """DeepSpeed's `data_types` section."""

    grad_accum_dtype: Optional[GradDtype] = Field(None, description="The dtype gradients are accumulated in "
        "across micro-steps and kept in until the optimizer step: 'fp32' in a bf16/fp16 run adds each micro-step's "
        "16-bit gradient into fp32 (stages 0-1: the full gradient buffer before the boundary's reduction; stages "
        "2-3: this rank's reduced shard). Unset: the compute dtype (DeepSpeed's default). Stages 1-3; at stage 0 "
        "only the compute dtype (DeepSpeed refuses other values there too). Also DeepSpeed's aliases "
        "('float32', 'bfloat16', 'half', ...).")

    @model_validator(mode="before")
    @classmethod
    def _canonical(cls, data: Any) -> Any:
        if isinstance(data, dict) and "grad_accum_dtype" in data:
            data = {**data, "grad_accum_dtype": dtype_name(data["grad_accum_dtype"], "data_types.grad_accum_dtype",
                                                            DTYPE_NAMES)}
        return data
