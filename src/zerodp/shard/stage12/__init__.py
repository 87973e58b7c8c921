"""ZeRO stages 0, 1 and 2 (DDP, the paper's P_os and P_os+g): parameters replicated, optimizer state (and
from stage 2 gradients) sharded; every rank keeps every parameter whole, in gradient buckets.

What these three stages share and stage 3 does not: parameters are replicated, never sharded, so
forward and backward run on the full model with no gather. They differ only by policy
(`buckets.ReducePolicy`): from stage 1 each rank steps only its shard of the optimizer state (and
all-gathers the updated parameters after the step); stage 2 also keeps only its shard of the reduced
gradients, reduced after every micro-step. Stage 3, whose parameters are sharded too, is `stage3/`.

    buckets.py   GradBucket (one communication unit: flat parameters + a GradShard), build_buckets, ReducePolicy
    strategy.py  GradReducer: the strategy the engine drives (hooks, ordered reductions, after-step gathers)
"""
