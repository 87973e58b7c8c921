"""ZeRO stages 0-2 (the paper's baseline, Pos and Pos+g): gradient buckets over whole parameters.

    buckets.py   GradBucket (one communication unit), build_buckets, GradReducer (the strategy)
"""
