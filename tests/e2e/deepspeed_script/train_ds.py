"""A training script written for DeepSpeed. The only change for zerodp is the import line below.

    torchrun --nproc_per_node 2 train_ds.py --deepspeed --deepspeed_config ds_config.json --out DIR
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

import zerodp.deepspeed as deepspeed  # was: import deepspeed


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1))


def make_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
    return torch.utils.data.TensorDataset(x, y)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    model = make_model()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=make_data())
    batches = list(loader)  # this rank's micro-batches, in order
    gas = engine.gradient_accumulation_steps()

    def train(first_step, last_step):
        losses, lrs = [], []
        for step in range(first_step, last_step):
            total = torch.zeros(())
            lrs.append(engine.get_lr()[0])
            for micro in range(gas):
                x, y = batches[step * gas + micro]
                loss = torch.nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                total += loss.detach() / gas
            if dist.is_initialized():
                dist.all_reduce(total)
                total /= dist.get_world_size()
            losses.append(total.item())
            assert engine.global_steps == step + 1
        return losses, lrs

    losses, lrs = train(0, args.save_at)
    engine.save_checkpoint(os.path.join(args.out, "ckpt"), client_state={"next_step": args.save_at})
    more, more_lrs = train(args.save_at, args.steps)
    weight = deepspeed.utils.safe_get_full_fp32_param(engine.module[0].weight)
    engine.save_16bit_model(args.out, "model.safetensors")

    # resume in a fresh engine from the checkpoint, and train the same steps again
    model2 = make_model()
    engine, _, _, _ = deepspeed.initialize(args=args, model=model2, model_parameters=model2.parameters())
    path, client_state = engine.load_checkpoint(os.path.join(args.out, "ckpt"))
    resumed, resumed_lrs = train(client_state["next_step"], args.steps)

    if deepspeed.comm.get_rank() == 0:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"losses": losses + more, "lrs": lrs + more_lrs, "resumed": resumed, "resumed_lrs": resumed_lrs,
                       "path": path, "world_size": deepspeed.comm.get_world_size(),
                       "train_batch_size": engine.train_batch_size(), "stage": engine.zero_optimization_stage(),
                       "weight0": weight.tolist()}, f)
    deepspeed.comm.barrier()


if __name__ == "__main__":
    main()
