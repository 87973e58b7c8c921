"""Scripts the GPU tests run as a user would, under torchrun on one GPU (tests/gpu/test_cuda_entry_points.py):

    python -m torch.distributed.run --nproc_per_node 1 tests/gpu/cuda_scripts.py deepspeed OUT.json
        a DeepSpeed-style script: init_distributed(dist_backend="cpu:gloo,cuda:nccl"), the model and its
        optimizer built on the CPU, deepspeed.initialize moves them to cuda:LOCAL_RANK, batches go to
        engine.device; 8 steps at stage 3 beside plain PyTorch on the GPU (losses, final parameters)
    python -m torch.distributed.run --nproc_per_node 1 tests/gpu/cuda_scripts.py zero_init OUT.json
        the same with the model built under deepspeed.zero.Init (slices made on the GPU), beside the same
        model built on the GPU
    python -m torch.distributed.run --nproc_per_node 1 tests/gpu/cuda_scripts.py trainer OUT.json
        ZeroTrainer for 2 steps on the GPU beside the plain Trainer (losses)
"""

import json
import sys

import torch
import torch.nn.functional as F

STEPS, ROWS, CLIP = 8, 8, 0.5


def _train_beside_plain(engine, model, reference, result: dict, out: str) -> None:
    """8 steps of `engine` (batches to engine.device) and of plain PyTorch on `reference` (on the GPU);
    writes the losses and the largest relative difference of each final parameter to `out`."""
    import zerodp
    from tests.dist.common import global_batch, make_optimizer
    from tests.oracle import train_reference

    losses = []
    for step in range(STEPS):
        x, y = (t.to(engine.device) for t in global_batch(step, ROWS))
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with zerodp.gathered_parameters(model.parameters()):
        params = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    def step_loss(model, step: int) -> torch.Tensor:
        x, y = (t.cuda() for t in global_batch(step, ROWS))
        return F.mse_loss(model(x), y)

    ref = train_reference(reference, make_optimizer("adamw", reference), STEPS, step_loss, clip=CLIP)
    ref_losses, ref_params = ref.losses, {k: v.cpu() for k, v in ref.params.items()}
    result.update(losses=losses, ref_losses=ref_losses,
                  param_max_rel_diff={k: float(((params[k] - v).abs() / (v.abs() + 1e-6)).max())
                                      for k, v in ref_params.items()})
    engine.destroy()
    with open(out, "w") as fh:
        json.dump(result, fh)


def _placement(engine, model, optimizer) -> dict:
    return {"backend": str(torch.distributed.get_backend()), "engine_device": str(engine.device),
            "param_devices": sorted({str(p.device) for p in model.parameters()}),
            "optimizer_holds_model_params": {id(p) for g in optimizer.param_groups for p in g["params"]}
            == {id(p) for p in model.parameters()}}


def deepspeed_script(out: str) -> None:
    import zerodp.deepspeed as deepspeed
    from tests.dist.common import make_model, make_optimizer

    torch.backends.cuda.matmul.allow_tf32 = False
    deepspeed.init_distributed(dist_backend="cpu:gloo,cuda:nccl")
    model = make_model()  # on the CPU, as DeepSpeed scripts build it
    optimizer = make_optimizer("adamw", model)  # over the CPU parameters, before initialize
    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_clipping": CLIP, "zero_optimization": {"stage": 3}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    _train_beside_plain(engine, model, make_model().cuda(), _placement(engine, model, optimizer), out)


def zero_init_script(out: str) -> None:
    """The model built under deepspeed.zero.Init: its slices are made on cuda:LOCAL_RANK and its initializers
    run there (the CUDA generator), so it equals the same model built on the GPU."""
    import zerodp.deepspeed as deepspeed
    from tests.dist.common import ParityNet, make_optimizer

    torch.backends.cuda.matmul.allow_tf32 = False
    deepspeed.init_distributed(dist_backend="cpu:gloo,cuda:nccl")
    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_clipping": CLIP,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = ParityNet()
    optimizer = make_optimizer("adamw", model)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    torch.manual_seed(0)
    with torch.device("cuda"):
        reference = ParityNet()
    _train_beside_plain(engine, model, reference, _placement(engine, model, optimizer), out)


def trainer_script(out: str) -> None:
    from transformers import Trainer

    from tests.hf.tiny_setup import Sequences, arguments, history, make_model
    from zerodp.adapters.hf.trainer import ZeroTrainer

    torch.backends.cuda.matmul.allow_tf32 = False
    zero = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "train_batch_size": "auto", "zero_optimization": {"stage": 2}}
    # no warm-up: step 2 runs after a real update (a first step at lr 0 would compare nothing)
    args = dict(max_steps=2, warmup_steps=0, eval_strategy="no", save_strategy="no", use_cpu=False, ddp_backend="nccl")
    trainer = ZeroTrainer(model=make_model(), args=arguments(f"{out}.zero", **args), train_dataset=Sequences(),
                          zero_config=zero)
    trainer.train()
    result = {"zero": history(trainer), "global_step": trainer.state.global_step,
              "param_devices": sorted({str(p.device) for p in trainer.model.parameters()})}
    plain = Trainer(model=make_model(), args=arguments(f"{out}.plain", **args), train_dataset=Sequences())
    plain.train()
    result["plain"] = history(plain)
    with open(out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    {"deepspeed": deepspeed_script, "zero_init": zero_init_script, "trainer": trainer_script}[sys.argv[1]](sys.argv[2])
