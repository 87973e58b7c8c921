"""ZeRO-Offload (cpu) and ZeRO-Infinity (nvme): config, rank folders, file I/O, stores, streamed optimizer state.

Entry point for the engine: `offload.tier.build_optimizer_offload`.
"""
