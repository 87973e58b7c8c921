"""Models bundled with zerodp, importable as library models (no download, plain PyTorch).

    gpt.py   a GPT-style decoder (GPT, GPTConfig, MODEL_PRESETS, lm_loss): the `zerodp train` workload,
             the model `zerodp estimate --model` sizes, and the model the tests and benchmarks train

They depend on torch (and zerodp.tensor_parallel, itself torch-only), never on the rest of zerodp, so any
layer may import them.

    tp_gpt.py  The GPT of models/gpt.py with Megatron's tensor parallelism: each rank of a tensor-parallel ...
"""
