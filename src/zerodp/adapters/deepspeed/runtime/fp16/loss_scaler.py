"""`deepspeed.runtime.fp16.loss_scaler`: the classes a DeepSpeed-layout checkpoint pickles its loss scaler as, so that
`torch.load(..., weights_only=False)` of such a file (PyTorch Lightning's converter does it) works under zerodp's
`deepspeed` alias. State holders only: zerodp's own scaler is zerodp.precision.LossScaler."""

from .....checkpoint.deepspeed_pickle import DynamicLossScaler, LossScaler

__all__ = ["LossScaler", "DynamicLossScaler"]
