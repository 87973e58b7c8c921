"""The TP x DP case shared by the tensor-parallel tests: a tiny tensor-parallel GPT with dropout, trained by
zerodp over the data-parallel group of a ModelParallelUnit, and the single-process reference that emulates it.

Reference (one process, the unsharded model): for every micro-step and every data-parallel rank d, the
micro-batch rank d trains on, with the random streams rank d has: torch's default generator (seeded alike on
every rank: the replicated dropouts) and each tensor-parallel rank's model-parallel stream, which drew the
attention dropout of that rank's heads. `EmulatedAttentionCore` draws head group t from stream t with the
shape tensor-parallel rank t used, so the masks are those of the 2-D run. The loss is the mean over ranks
and micro-steps (what ZeRO's averaging computes); clipping is torch's clip_grad_norm_.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import zerodp
from zerodp.tools.models.gpt import GPTConfig, lm_loss
from zerodp.tools.models.tp_gpt import TensorParallelGPT, tp_lm_loss
from zerodp.tensor_parallel import (MODEL_PARALLEL_RNG, ModelParallelUnit, RNGStatesTracker, merge_state_dicts,
                                    seed_model_parallel, tensor_parallel_specs)
from zerodp.tensor_parallel.random import MODEL_PARALLEL_SEED_OFFSET
from tests.oracle import train_reference

TP, DP = 2, 2
CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16, dropout=0.1)
SEED, MICRO_BS, GAS, LR = 7, 2, 2, 1e-2
STEPS_DEFAULT = 3  # optimizer steps of the runs compared with the reference
CLIP = 0.05  # below every step's norm here (~0.3-1): clipping acts on every step, so the norm's rule matters


def config(stage: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO_BS, "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP,
            "zero_optimization": {"stage": stage, **zero, **(  # several buckets or units per tensor-parallel rank
                {"stage3_param_persistence_threshold": 0} if stage == 3 else
                {"reduce_bucket_size": 500, "allgather_bucket_size": 300})}}


def make_optimizer(name: str, params):
    if name == "sgd":  # the update is proportional to the clipped gradient: a wrong norm shows in every weight
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def micro_batch(step: int, micro: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dp_rank)
    x = torch.randint(0, CFG.vocab_size, (MICRO_BS, CFG.block_size + 1), generator=g)
    return x[:, :-1], x[:, 1:]


# -- the 2-D run (on every rank of a 4-rank pool) ----------------------------------------------------


class TPRun:
    """One TP x DP training run on this rank: the mpu, the tracker, the model and its engine."""

    def __init__(self, stage: int, opt_name: str, *, extra: dict | None = None, via_deepspeed: bool = False,
                 activation_checkpointing: dict | None = None, **zero) -> None:
        self.mpu = ModelParallelUnit(TP)
        self.checkpointing = activation_checkpointing
        if activation_checkpointing is not None:  # Megatron-DeepSpeed's calls: configure(mpu, ...), its tracker
            self.tracker = _configure_checkpointing(self.mpu, activation_checkpointing)
        else:
            self.tracker = RNGStatesTracker("cpu")
        self.model = model = TensorParallelGPT(CFG, self.mpu, rng=self.tracker, seed=SEED)
        if activation_checkpointing is not None:
            from zerodp.adapters.deepspeed import checkpointing

            model.checkpoint_fn = checkpointing.checkpoint  # every block checkpointed, its input kept as configured
        self.specs = tensor_parallel_specs(model)
        cfg = {**config(stage, **zero), **(extra or {})}
        optimizer = make_optimizer(opt_name, model.parameters())
        if via_deepspeed:  # Megatron-DeepSpeed's call: deepspeed.initialize(model=..., mpu=mpu)
            import zerodp.deepspeed as deepspeed

            self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg, mpu=self.mpu)
        else:
            self.engine = zerodp.initialize(model, optimizer, cfg, mpu=self.mpu)
        self.reseed()

    def reseed(self) -> None:
        """Seed torch's default generator and the tracker's model-parallel stream as Megatron does."""
        if self.checkpointing is not None:
            from zerodp.adapters.deepspeed import checkpointing

            checkpointing.model_parallel_cuda_manual_seed(SEED)  # the tensor-parallel rank comes from the mpu
        else:
            seed_model_parallel(self.tracker, SEED, self.mpu.get_tensor_model_parallel_rank())

    def train(self, steps: range) -> tuple[list[float], list[float]]:
        losses, norms = [], []
        for step in steps:
            for micro in range(GAS):
                x, y = micro_batch(step, micro, self.mpu.get_data_parallel_rank())
                loss = tp_lm_loss(self.engine(x), y, self.mpu.get_tensor_model_parallel_group())
                self.engine.backward(loss)
                self.engine.step()
                losses.append(loss.item())
            norms.append(self.engine.grad_norm)
        return losses, norms

    def close(self) -> None:
        self.engine.close()
        if self.checkpointing is not None:  # the process-wide configuration would outlive this run's groups
            from zerodp.activations import PROCESS

            PROCESS.checkpointer = PROCESS.mpu = None
        self.mpu.destroy()


def _configure_checkpointing(mpu, settings: dict):
    """deepspeed.checkpointing.configure(mpu, deepspeed_config=...) with `settings`; returns its RNG tracker."""
    from zerodp.activations import PROCESS, RNGStatesTracker as ProcessTracker
    from zerodp.adapters.deepspeed import checkpointing

    PROCESS.tracker = ProcessTracker("cpu")  # these gloo ranks compute on the CPU, also where CUDA exists
    checkpointing.configure(mpu, deepspeed_config={"activation_checkpointing": settings})
    return checkpointing.get_cuda_rng_tracker()


# -- the reference (one process) ---------------------------------------------------------------------


class EmulatedAttentionCore(nn.Module):
    """The attention of all heads, head group t's dropout drawn from tensor-parallel rank t's stream."""

    def __init__(self, dropout: float, streams: "ReferenceStreams") -> None:
        super().__init__()
        self.dropout, self.streams = dropout, streams

    def forward(self, q, k, v):
        p = self.dropout if self.training else 0.0
        outs = []
        for t, (qt, kt, vt) in enumerate(zip(q.chunk(TP, 1), k.chunk(TP, 1), v.chunk(TP, 1))):
            with self.streams.current.fork(f"tp{t}"):
                outs.append(F.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=True))
        return torch.cat(outs, dim=1)


class ReferenceStreams:
    """Each data-parallel rank's random streams: torch's default state and a tracker of TP model-parallel streams."""

    def __init__(self) -> None:
        self.default, self.trackers = [], []
        for _ in range(DP):
            tracker = RNGStatesTracker("cpu")
            for t in range(TP):
                tracker.add(f"tp{t}", SEED + MODEL_PARALLEL_SEED_OFFSET + t)
            self.trackers.append(tracker)
            self.default.append(torch.Generator().manual_seed(SEED).get_state())
        self.current = self.trackers[0]


def reference_run(opt_name: str, steps: int) -> tuple[list[list[float]], list[float], dict]:
    """Losses per data-parallel rank, gradient norms per step, and the final parameters of the oracle's run."""
    model = TensorParallelGPT(CFG, seed=SEED)
    streams = ReferenceStreams()
    for block in model.blocks:
        block.attn.core = EmulatedAttentionCore(CFG.dropout, streams)
    losses = [[] for _ in range(DP)]

    def rank_loss(model: nn.Module, step: int, chunk: int) -> torch.Tensor:
        """chunk = micro * DP + d: data-parallel rank d's micro-batch `micro`, drawn from rank d's streams."""
        micro, d = divmod(chunk, DP)
        torch.set_rng_state(streams.default[d])
        streams.current = streams.trackers[d]
        x, y = micro_batch(step, micro, d)
        loss = lm_loss(model(x), y)
        streams.default[d] = torch.get_rng_state()  # the forward drew its dropouts; backward draws none
        losses[d].append(loss.item())
        return loss

    saved = torch.get_rng_state()
    ref = train_reference(model, make_optimizer(opt_name, model.parameters()), steps, rank_loss, clip=CLIP,
                          accumulation=DP * GAS, named_parameters_only=True)
    torch.set_rng_state(saved)
    return losses, ref.grad_norms, ref.params


def unsharded(per_tp_state_dicts: list[dict], specs: dict) -> dict:
    """The unsharded parameters from tensor-parallel ranks 0..TP-1's full state dicts."""
    return merge_state_dicts(per_tp_state_dicts, specs)


__all__ = ["TP", "DP", "CFG", "TPRun", "reference_run", "unsharded", "config", "MODEL_PARALLEL_RNG"]
