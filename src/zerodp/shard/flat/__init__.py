"""Flat layouts and buffers: many parameters as one padded tensor, split into equal per-rank shards.

The arithmetic and storage that parameters, gradients and optimizer state all use; the gradients' life
cycle over them (filling, reducing, reduced) is `grads/`.

    layout.py   FlatLayout: offsets, padding and each rank's segments; pure arithmetic, no torch.distributed
    whole_tensor_layout.py  WholeTensorLayout: shard boundaries on tensor boundaries (Muon, Adafactor)
    buffer.py   FlatBuffer: one contiguous tensor with per-parameter views; freeing and re-allocating storage
"""
