"""ZeRO-Offload (cpu) and ZeRO-Infinity (nvme): config, rank folders, file I/O, stores, streamed optimizer state.

Entry point for the engine: `offload.tier.build_optimizer_offload`.

Modules:
    file_io.py          Asynchronous reads and writes of raw tensor bytes: a thread pool of os.preadv / os.pwritev.
    footprint.py        The bytes an offload tier holds, per rank: host memory and disk, as arithmetic (the offload ...
    null_store.py       The home of shards that are not offloaded: `NullShardStore`, a `ShardStore` that keeps nothing.
    optimizer_state.py  The optimizer state of an offloaded run, streamed through the step one window at a time.
    placement.py        Where each state of a training run lives, decided once from the config and the model's device: ...
    run_dir.py          The folder that holds one rank's offload files: nvme_path/zerodp-<run id>/rank<r>/.
    shard_entry.py      One offloaded stage-3 shard as `shard_store.ShardStore` tracks it: its tensor, backing store ...
    shard_store.py      Stage-3 shards that live off the compute memory: `ShardStore`.
    store.py            Where offloaded flat tensors live: host memory (`HostStore`) or one file per tensor ...
    tier.py             Building the offload tier for an engine from its config, with every check done before any work.
"""
