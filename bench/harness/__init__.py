"""The benchmark harness: zerodp's stages side by side with the peers, as a user would compare them.

It lives in the checkout, outside the installed package (`pip install zerodp` ships no harness that
writes into the working directory). From the repository root: `make bench`, or

    python -m bench.harness [--model tiny] [--strategies ddp zerodp3] [--interleaved] ...

    models.py        the benchmark GPTs and their synthetic token stream
    strategies.py    DDP, ZeroRedundancyOptimizer, FSDP1/2, DeepSpeed and zerodp behind one Runner
    live_memory.py   peak live (malloc in-use) bytes during a step, sampled by a thread
    worker.py        one strategy on N ranks under torchrun: times, memory, traffic, losses (JSON)
    interleaved.py   every strategy in one process pair, stepped in turn: drift-free step-time ratios
    runner.py        alternating rounds, ratios to DDP, bench/RESULTS.md and a PNG chart; the sweep;
                     --interleaved runs interleaved.py
"""
