"""Hugging Face (optional extra `zerodp[hf]`; the runtime never imports it).

    trainer.py      ZeroTrainer: the transformers Trainer, training with zerodp instead of DDP
    auto_values.py  a DeepSpeed-style config's "auto" values filled from TrainingArguments
"""
