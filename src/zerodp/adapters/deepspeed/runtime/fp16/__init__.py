"""`deepspeed.runtime.fp16`: the loss scaler classes DeepSpeed's checkpoints pickle.

    loss_scaler.py  `deepspeed.runtime.fp16.loss_scaler`: LossScaler, DynamicLossScaler (read as inert records)
"""
