"""ZeRO stages 0-2 (the paper's baseline, Pos and Pos+g): gradient buckets over whole parameters.

    buckets.py   GradBucket (one communication unit: flat parameters + a GradShard), build_buckets, ReducePolicy
    strategy.py  GradReducer: the strategy the engine drives (hooks, ordered reductions, after-step gathers)
"""
