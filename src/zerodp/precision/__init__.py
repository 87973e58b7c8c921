"""Numerics of a training step: the dtypes each state is kept in and their casts.

    policy.py     PrecisionPolicy (parameter, reduce and master dtypes) and the dynamic LossScaler
    autocast.py   AutocastPolicy: torch.autocast mixed precision (DeepSpeed's `torch_autocast` section)

What happens to a non-finite gradient is the engine's (engine/nonfinite.py). Nothing is imported here:
`zerodp.config` imports autocast.py, and policy.py imports the config.
"""
