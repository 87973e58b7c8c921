"""A pretraining script in Megatron-DeepSpeed's shape, written for the tests: `import deepspeed`, Megatron's
mpu (mpu.py beside it), `deepspeed.checkpointing.configure(mpu, deepspeed_config=..., ...)` and
`model_parallel_cuda_manual_seed`, a tensor-parallel GPT whose attention dropout forks the checkpointing
module's RNG tracker and whose blocks go through `deepspeed.checkpointing.checkpoint`, then
`deepspeed.initialize(model=..., model_parameters=..., config=..., mpu=mpu)`.

    torchrun --nproc_per_node 4 -m zerodp.deepspeed.run pretrain_tp_gpt.py --deepspeed_config ds.json \
        --tensor-model-parallel-size 2 --checkpoint-activations --train-iters 3 --out losses.jsonl

Each rank writes its losses and grad norms as JSON to <--out>.rank<R>.
"""

import argparse
import json

import deepspeed
import torch
import torch.distributed as dist

import mpu
from zerodp.tools.models.gpt import GPTConfig
from zerodp.tools.models.tp_gpt import TensorParallelGPT, tp_lm_loss


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--checkpoint-activations", action="store_true")
    parser.add_argument("--train-iters", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config
    return parser.parse_args()


def batch(step: int, micro: int, dp_rank: int, micro_bs: int, config: GPTConfig):
    """Each data-parallel rank's micro-batch of random tokens (a stand-in for Megatron's data loader)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dp_rank)
    x = torch.randint(0, config.vocab_size, (micro_bs, config.block_size + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    mpu.initialize_model_parallel(args.tensor_model_parallel_size)
    if args.checkpoint_activations:
        deepspeed.checkpointing.configure(mpu, deepspeed_config=args.deepspeed_config)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(args.seed)

    config = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16, dropout=0.1)
    model = TensorParallelGPT(config, mpu, rng=deepspeed.checkpointing.get_cuda_rng_tracker(), seed=args.seed)
    if args.checkpoint_activations:
        model.checkpoint_fn = deepspeed.checkpointing.checkpoint
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=args.deepspeed_config, mpu=mpu)
    # Megatron seeds once, before building the model (whose torch layers draw their default init from the default
    # generator); seeding again here starts the dropout streams where the test's single-process reference does
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(args.seed)

    losses, norms = [], []
    for step in range(args.train_iters):
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = batch(step, micro, mpu.get_data_parallel_rank(), engine.train_micro_batch_size_per_gpu(), config)
            loss = tp_lm_loss(engine(x), y, mpu.get_tensor_model_parallel_group())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    with open(f"{args.out}.rank{dist.get_rank()}", "w") as f:
        json.dump({"rank": dist.get_rank(), "tp": mpu.get_tensor_model_parallel_rank(),
                   "dp": mpu.get_data_parallel_rank(), "losses": losses, "grad_norms": norms}, f)
    engine.destroy()
    mpu.destroy_model_parallel()


if __name__ == "__main__":
    main()
