"""The optimizer library and the learning-rate schedules, apart from the sharded step that drives them (optim/).

    lamb.py             LAMB (You et al., 2019)
    fused_adam.py       Adam as DeepSpeed's FusedAdam computes it, exact on flat shards
    fused_lamb.py       LAMB as DeepSpeed's FusedLamb computes it
    lion.py             Lion (Chen et al., 2023)
    larc.py             LARC: layer-wise adaptive rate control around any optimizer
    optimizer_list.py   OptimizerList: several optimizers over disjoint parameter sets, stepped as one
    selection.py        several optimizers from the config (a list of `optimizer` sections)
    deepspeed_types.py  DeepSpeed's `optimizer: {type, params}` with DeepSpeed's meaning
    lr_schedules.py     DeepSpeed's learning-rate schedules (the config's `scheduler` section)
    client_schedule.py  a schedule the caller brought (`initialize(lr_scheduler=...)`), as the engine steps it

    shard_norms.py  Per-parameter norms of tensors that may be flat shards of several parameters.
"""
