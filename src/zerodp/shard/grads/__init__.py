"""The gradient machine every stage uses: one flat gradient buffer per unit, from the backward that fills it
to the reduced shard the optimizer reads (IDLE, FILLING, REDUCING, REDUCED), over `flat/`'s layouts.

    grad_shard.py       GradShard: THE gradient life cycle (hooks fill views of one buffer, one reduction,
                        the persistent shard accumulated in grad_accum_dtype); the global squared norm
    grad_arithmetic.py  GradArithmetic: a reduction's dtypes and divisors (DeepSpeed's four keys), at every stage
    split_reduce.py     SplitReduce: one buffer reduced in two dtypes (torch_autocast at stage 3)
    reduce_queue.py     ReduceQueue: the order reductions are launched in, and the control collective that
                        ends a backward (stage 0-2 buckets and stage-3 units alike)

    bucket_intake.py  A bucket's gradients taken in with one hook, not one per parameter: `BucketIntake` (stages ...
    grad_destination.py  GradDestination: where a shard's deliveries also go (ZeRO-Offload's host staging)
    grad_state.py     The states of one gradient shard's life cycle (`grads.grad_shard.GradShard`) and the ...
    param_hook.py     The post-accumulate-grad hook of one parameter of a `grads.grad_shard.GradShard`: `param_hook`.
"""
