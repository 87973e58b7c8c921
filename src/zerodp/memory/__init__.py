"""Memory the runtime accounts for: what a live rank holds, measured against the paper's bytes per stage.

    model_states.py  the ZeRO paper's model-state bytes per rank at each stage (pure arithmetic)
    report.py        MemoryReport: what this rank's engine actually holds (`engine.memory_report()`)

Estimates made before launch (the paper's tables, peak RSS, what fits) are planners: `zerodp.plan`.
"""
