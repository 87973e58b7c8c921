"""The sharded model states of the ZeRO paper: P_os (stage 1), P_os+g (stage 2), P_os+g+p (stage 3).

    flat/      many parameters as one padded flat tensor, split into equal per-rank shards
    grads/     the gradient life cycle every stage uses: hooks, buckets, reduction rounds, the rank's shard
    stage12/   stages 0-2: parameters replicated, optimizer state (and gradients) sharded
    stage3/    stage 3: parameters sharded too, gathered just in time, prefetched, released after use
    seams.py   the protocols between the strategies, the optimizer and checkpoints (typing.Protocol)
"""
