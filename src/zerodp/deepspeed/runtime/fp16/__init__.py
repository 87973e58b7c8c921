"""`deepspeed.runtime.fp16`: the loss scaler classes DeepSpeed's checkpoints pickle (loss_scaler)."""
