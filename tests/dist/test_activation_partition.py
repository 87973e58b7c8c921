"""ZeRO-R across ranks on gloo: partitioned checkpoints (Pa) with a 2-rank model-parallel group, alone and
with host offload and contiguous buffers, exact against plain PyTorch with dropout from the default
generator and the RNG tracker, with each rank keeping half the bytes; and activation checkpointing of the
bundled GPT's blocks inside a zerodp engine at ZeRO stages 1-3, exact against plain PyTorch on the global
batch (and, with dropout on, against the same engine without checkpointing)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerodp
from zerodp.activations import DEVICE, HOST, Checkpointer, RNGStatesTracker
from zerodp.activations.model_parallel import ModelParallelGroup
from zerodp.config.activation_checkpointing import ActivationCheckpointingConfig as Settings
from zerodp.tools.models.gpt import GPT, GPTConfig, lm_loss
import zerodp.deepspeed as deepspeed
from tests.activation_regions import assert_same, region_input_bytes, train
from tests.oracle import train_reference


class GroupMPU:
    """A minimal Megatron-style mpu: the whole world is the model-parallel group, each rank its own DP group."""

    def __init__(self, group=None):
        self.group = group if group is not None else dist.group.WORLD

    def get_model_parallel_group(self):
        return self.group

    def get_model_parallel_rank(self):
        return dist.get_rank(self.group)

    def get_model_parallel_world_size(self):
        return dist.get_world_size(self.group)

    def get_data_parallel_rank(self):
        return 0


PARTITIONED = {
    "Pa": dict(partition_activations=True),
    "Pa+cpu": dict(partition_activations=True, cpu_checkpointing=True),
    "Pa+CB": dict(partition_activations=True, contiguous_memory_optimization=True),
    "Pa+cpu+CB": dict(partition_activations=True, cpu_checkpointing=True, contiguous_memory_optimization=True,
                      number_checkpoints=3),
}


def partition_cases() -> list[str]:
    """Every partitioned setting in both forms on this rank; the plain reference runs here too."""
    group = ModelParallelGroup.from_mpu(GroupMPU())
    reference = train(None, None)
    checked = []
    for name, keys in PARTITIONED.items():
        for form in ("checkpoint", "non_reentrant_checkpoint"):
            checkpointer = Checkpointer(Settings(**keys), group, RNGStatesTracker("cpu"))
            assert_same(reference, train(checkpointer, form))
            kept = checkpointer.kept_bytes
            place, other = (HOST, DEVICE) if keys.get("cpu_checkpointing") else (DEVICE, HOST)
            # Each of the 2 ranks keeps ceil(numel/2) of every input: half the bytes of plain checkpointing.
            assert kept.peak[place] == region_input_bytes(parts=2) < region_input_bytes(), (name, kept)
            assert kept.peak[other] == 0 and kept.live == {DEVICE: 0, HOST: 0}, (name, kept)
            checked.append(f"{name}/{form}")
    # The same through DeepSpeed's module-level API, as Megatron-DeepSpeed calls it (its tracker on the CPU
    # generator these regions draw from, also where CUDA exists).
    zerodp.activations.PROCESS.tracker = RNGStatesTracker("cpu")
    deepspeed.checkpointing.configure(GroupMPU(), deepspeed_config={"activation_checkpointing": {
        "partition_activations": True, "cpu_checkpointing": True}}, num_checkpoints=3)
    process = zerodp.activations.PROCESS.checkpointer
    assert_same(reference, train(process, "checkpoint"))
    assert process.kept_bytes.peak[HOST] == region_input_bytes(parts=2)
    zerodp.activations.PROCESS.checkpointer = zerodp.activations.PROCESS.mpu = None
    return checked


def test_partitioned_checkpoints_exact_and_halved(dist_run):
    results = dist_run(2, partition_cases)
    assert results[0] == results[1] and len(results[0]) == 2 * len(PARTITIONED)


# -- inside a zerodp engine ----------------------------------------------------------------------------

STEPS, MICRO = 3, 2
ENGINE_CASES = {  # stage, form, activation_checkpointing section
    "stage1-reentrant-cpu": (1, "checkpoint", {"cpu_checkpointing": True}),
    "stage2-nonreentrant-CB": (2, "non_reentrant_checkpoint", {"contiguous_memory_optimization": True}),
    "stage3-reentrant-cpu+CB": (3, "checkpoint", {"cpu_checkpointing": True, "contiguous_memory_optimization": True}),
    "stage3-nonreentrant": (3, "non_reentrant_checkpoint", {}),
}


def gpt(dropout: float) -> GPT:
    return GPT(GPTConfig(vocab_size=31, block_size=8, n_layer=3, n_head=2, n_embd=12, dropout=dropout), seed=4)


def batch(step: int, rows: int):
    ids = torch.randint(0, 31, (rows, 8), generator=torch.Generator().manual_seed(100 + step))
    return ids[:, :-1], ids[:, 1:]


def engine_run(stage: int, form: str | None, section: dict | None, dropout: float = 0.0):
    """Per-step global losses and the final parameters of zerodp training the GPT, its blocks checkpointed
    with `form` (None: not checkpointed), on this rank's slice of each global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(10 + rank)  # dropout masks: per rank, equal with and without checkpointing
    model = gpt(dropout)
    zero = {"stage": stage, **({"stage3_unit_modules": ["Block"]} if stage == 3 else {})}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.5, "zero_optimization": zero}
    if section is not None:
        config["activation_checkpointing"] = section
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), config)
    if form is not None:
        model.checkpoint_fn = getattr(zerodp.activations, form)  # the process's checkpointer, set by initialize
    losses = []
    for step in range(STEPS):
        x, y = batch(step, MICRO * world)
        loss = lm_loss(engine(x[rank * MICRO:(rank + 1) * MICRO]), y[rank * MICRO:(rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    kept = zerodp.activations.PROCESS.current().kept_bytes
    with zerodp.gathered_parameters(model.parameters()):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    zerodp.activations.PROCESS.checkpointer = None
    return losses, state, dict(kept.peak), dict(kept.live)


def engine_case(name: str):
    stage, form, section = ENGINE_CASES[name]
    checkpointed = engine_run(stage, form, section)
    with_dropout = engine_run(stage, form, section, dropout=0.2)
    without = engine_run(stage, None, None, dropout=0.2)
    return checkpointed, with_dropout, without


def reference():
    def step_loss(model, step: int) -> torch.Tensor:
        x, y = batch(step, MICRO * 2)
        return lm_loss(model(x), y)

    model = gpt(0.0)
    ref = train_reference(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), STEPS, step_loss, clip=0.5)
    return ref.losses, ref.params


@pytest.mark.parametrize("name", list(ENGINE_CASES))
def test_checkpointed_gpt_in_a_zerodp_engine(dist_run, name):
    results = dist_run(2, engine_case, name)
    ref_losses, ref_state = reference()
    initial = gpt(0.0).state_dict()
    assert max((ref_state[k] - initial[k]).abs().max().item() for k in initial) > 1e-3, "parameters must move"
    section = ENGINE_CASES[name][2]
    block_input = MICRO * 7 * 12 * 4  # one block's input: micro batch x 7 tokens x 12 wide, fp32
    for rank, ((losses, state, peak, live), (d_losses, d_state, _, _), (n_losses, n_state, _, _)) in enumerate(results):
        # fp32 on both sides; a sharded reduction sums in another order: rtol 1e-5 as the other parity tests
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for key, ref in ref_state.items():
            torch.testing.assert_close(state[key], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {key}: {m}")
        # dropout on: checkpointing changes nothing at all (same ranks, same order of every operation)
        assert d_losses == n_losses, (d_losses, n_losses)
        for key in n_state:
            assert torch.equal(d_state[key], n_state[key]), key
        place = HOST if section.get("cpu_checkpointing") else DEVICE
        assert peak[place] == 3 * block_input and live == {DEVICE: 0, HOST: 0}, (peak, live)
