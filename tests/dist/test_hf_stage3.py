"""Hugging Face models at ZeRO stage 3 (2 and 3 gloo ranks): a PEFT LoRA GPT-2 trains like plain PyTorch
with gradient and optimizer memory of the LoRA parameters only; HF gradient checkpointing and generate()
work on partitioned parameters and match the plain model."""

import pytest
import torch
import torch.distributed as dist

import zerodp
from tests.oracle import train_reference
from tests.dist.common import assert_adam_params_close, train_own_tokens

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SEQ, VOCAB, MICRO_BS, STEPS = 10, 40, 2, 3


def make_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ + 6, n_embd=24, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def make_lora():
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0)
    model = peft.get_peft_model(make_gpt2(), config)
    torch.manual_seed(1)
    with torch.no_grad():  # LoRA starts with B = 0; give B values so that A gets gradients from step 1
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def batch(step: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    start, stride = torch.randint(0, VOCAB, (rows, 1), generator=g), torch.randint(1, 4, (rows, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % VOCAB


STAGE3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 0,
                                "stage3_unit_modules": ["GPT2Block"]}}


def plain_run(make, opt_for, steps: int, world: int, checkpointing: bool = False):
    model = make()
    if checkpointing:
        model.gradient_checkpointing_enable()
    def step_loss(model, step: int) -> torch.Tensor:
        ids = batch(step, MICRO_BS * world)
        return model(input_ids=ids, labels=ids).loss

    ref = train_reference(model, opt_for([p for p in model.parameters() if p.requires_grad]), steps, step_loss)
    return ref.model, ref.losses


def zero_run(make, opt_for, steps: int, checkpointing: bool = False):
    model = make()
    if checkpointing:
        model.gradient_checkpointing_enable()
    engine = zerodp.initialize(model, opt_for([p for p in model.parameters() if p.requires_grad]), STAGE3)
    return engine, model, train_own_tokens(engine, steps, batch, MICRO_BS)


LR = 1e-2


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def lora_case():
    world = dist.get_world_size()
    engine, model, losses = zero_run(make_lora, adamw, STEPS)
    report = engine.memory_report().as_dict()
    with zerodp.gathered_parameters(model.parameters()):
        lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    ref_model, ref_losses = plain_run(make_lora, adamw, STEPS, world)
    ref_lora = {n: p.detach().clone() for n, p in ref_model.named_parameters() if "lora_" in n}
    lora_numel = sum(p.numel() for p in ref_lora.values())
    base_numel = sum(p.numel() for n, p in ref_model.named_parameters() if "lora_" not in n)
    return losses, ref_losses, lora, ref_lora, report, lora_numel, base_numel


def checkpointing_and_generate_case():
    world = dist.get_world_size()
    engine, model, losses = zero_run(make_gpt2, sgd, 2, checkpointing=True)
    ref_model, ref_losses = plain_run(make_gpt2, sgd, 2, world)  # reference without checkpointing
    prompt = batch(50, 2)[:, :4]
    model.eval()
    ref_model.eval()
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        expected = ref_model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    return losses, ref_losses, generated, expected


@pytest.mark.parametrize("world", [2, 3])
def test_lora_stage3_trains_lora_only(dist_run, world):
    for rank, (losses, ref_losses, lora, ref_lora, report, lora_numel, base_numel) in enumerate(
            dist_run(world, lora_case, timeout=180)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        assert ref_losses[-1] < ref_losses[0]
        assert_adam_params_close(lora, ref_lora, LR, STEPS, where=f"rank {rank}")
        # the bound is tight enough to see a wrong update: one element off by 1e-4 fails
        name = next(iter(ref_lora))
        wrong = dict(lora, **{name: lora[name].clone()})
        wrong[name].view(-1)[0] += 1e-4
        with pytest.raises(AssertionError):
            assert_adam_params_close(wrong, ref_lora, LR, STEPS)
        # only the LoRA parameters are trainable, so gradients and optimizer state are LoRA-sized, sharded
        assert report["numel"] == lora_numel
        padded = report["numel"] + report["padding_numel"]
        assert report["grads_bytes"] <= 4 * padded // world + 64
        assert report["optimizer_bytes"] == pytest.approx(report["optimizer_bytes_predicted"], rel=0.05)
        assert report["optimizer_bytes"] < 3 * 4 * padded // world + 1024  # fp32 Adam moments (+ master) of LoRA
        assert report["frozen_param_bytes"] < 4 * base_numel * 0.75  # the frozen base is sharded too


@pytest.mark.parametrize("world", [2])
def test_gradient_checkpointing_and_generate_stage3(dist_run, world):
    for losses, ref_losses, generated, expected in dist_run(world, checkpointing_and_generate_case, timeout=180):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        assert torch.equal(generated, expected)


def init_context_case():
    """from_config inside zerodp.init_context: parameters are born partitioned; then train like the plain model."""
    with zerodp.init_context(STAGE3):
        model = make_gpt2()
    partitioned = all(isinstance(p, zerodp.shard.stage3.PartitionedParameter) for p in model.parameters())
    engine = zerodp.initialize(model, sgd(list(model.parameters())), STAGE3)
    world, rank = dist.get_world_size(), dist.get_rank()
    losses = []
    for step in range(2):
        ids = batch(step, MICRO_BS * world)[rank * MICRO_BS:(rank + 1) * MICRO_BS]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    _, ref_losses = plain_run(make_gpt2, sgd, 2, world)
    return partitioned, losses, ref_losses


@pytest.mark.parametrize("world", [2])
def test_from_config_under_init_context(dist_run, world):
    for partitioned, losses, ref_losses in dist_run(world, init_context_case, timeout=180):
        assert partitioned
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
