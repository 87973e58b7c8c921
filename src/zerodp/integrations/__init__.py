"""Integrations with training frameworks (optional extras; the core never imports them).

    zerodp.integrations.transformers.ZeroTrainer   Hugging Face Trainer training with zerodp (`zerodp[hf]`)
    zerodp.integrations.vissl.initialize           a VISSL config file: engine + VISSL's lr schedule (zerodp.vissl)
"""
