"""The step-time predictor: compute + the communication the schedule cannot hide + the optimizer.

The overlap rule. A step is `A` micro-steps (gradient accumulation), each a forward and a backward
phase; the backward does twice the forward's FLOPs (plus the re-run forward under activation
checkpointing). In each phase, its transfers (plan.py) split into the part the schedule cannot
hide (`exposed_fraction`: the first unit's all-gather, which nothing precedes; the last unit's
reduction, which nothing follows; blocking tensor-parallel all-reduces) and the rest, C, which
runs beside the phase's compute T (prefetched gathers, bucketed reductions):

    phase time = T + exposed + C - overlap * min(C, T)

With overlap = 1 this is max(T, C) + exposed: communication longer than the compute shows.
Transfers of the AFTER phase (stage 1/2's all-gather of updated parameters) are fully exposed.
Per-step transfers (stage 0/1's single reduction) run in the last micro-step only. Then

    step = sum over micro-steps of (forward + backward) + after + optimizer
    optimizer = (parameters this rank updates) * optimizer_s_per_param
    tokens/s/GPU = tokens_per_rank / tp / step;  MFU = model FLOPs per GPU / step / peak

Model-state memory per GPU (mixed-precision Adam, 16 bytes per parameter, the ZeRO paper's
formulas, Psi per TP slice, N = data-parallel ranks, g = GPUs per node): stage0 16Psi, stage1
4Psi + 12Psi/N, stage2 2Psi + 14Psi/N, stage3/qwz/qgz 16Psi/N, hpz/zeropp 16Psi/N + 2Psi/g (the
secondary bf16 shard), mics 16Psi/g. `fits` asks for 20% of the device left for activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..formulas import precision_bytes, predict_model_state_bytes
from .cluster import ClusterSpec
from .plan import Layout, Phase, Transfer, plan, tensor_parallel_transfers
from .workload import Workload

ACTIVATION_RESERVE = 0.2   # of device memory, left for activations and buffers in the fit check


@dataclass(frozen=True)
class Prediction:
    mode: str
    world: int
    step_s: float
    compute_s: float
    exposed_comm_s: float
    optimizer_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    inter_bytes_per_gpu: float      # one step, every micro-step included
    intra_bytes_per_gpu: float
    model_state_gb: float
    fits: bool


def model_state_bytes(mode: str, numel: float, dp: int, per_node: int) -> float:
    """Bytes of parameters, gradients and Adam states one GPU keeps (module docstring): the memory
    estimator's per-stage formula over the group that shards, plus hpZ's secondary bf16 shard."""
    stage = int(mode[-1]) if mode.startswith("stage") else 3
    group = per_node if mode == "mics" else dp
    param_bytes, grad_bytes, optimizer_bytes = precision_bytes("mixed", "adam")
    states = predict_model_state_bytes(numel, group, stage, param_bytes=param_bytes, grad_bytes=grad_bytes,
                                       optimizer_bytes=optimizer_bytes).total
    return states + (param_bytes * numel / per_node if mode in ("hpz", "zeropp") else 0.0)


def _phase_seconds(compute_s: float, transfers: list[Transfer], cluster: ClusterSpec) -> float:
    exposed = hidden = 0.0
    for t in transfers:
        seconds = t.seconds(cluster)
        exposed += seconds * t.exposed_fraction
        hidden += seconds * (1.0 - t.exposed_fraction)
    return compute_s + exposed + hidden - cluster.overlap * min(hidden, compute_s)


def predict(mode: str, workload: Workload, cluster: ClusterSpec, world: int, tp: int = 1) -> Prediction:
    """Step time, throughput, MFU and bytes of `mode` on `world` GPUs of `cluster` (module docstring)."""
    layout = Layout.of(world, cluster.gpus_per_node, tp)
    micro_steps = workload.micro_steps
    micro_tokens = workload.tokens_per_rank // micro_steps
    transfers = plan(mode, workload, layout) + tensor_parallel_transfers(workload, layout, micro_tokens)

    flops_micro = workload.hardware_flops_per_rank / micro_steps / tp
    model_fwd = workload.model_flops_per_rank / micro_steps / tp / 3.0
    forward_s = model_fwd / cluster.effective_flops
    backward_s = flops_micro / cluster.effective_flops - forward_s

    def micro_step(last: bool) -> float:
        chosen = [t for t in transfers if t.per_micro_step or last]
        fwd = [t for t in chosen if t.phase is Phase.FORWARD]
        bwd = [t for t in chosen if t.phase is Phase.BACKWARD]
        return _phase_seconds(forward_s, fwd, cluster) + _phase_seconds(backward_s, bwd, cluster)

    after_s = sum(t.seconds(cluster) for t in transfers if t.phase is Phase.AFTER)
    # the optimizer updates this rank's shard: all of it at stage 0, 1/g within a MiCS/HSDP group
    shards = 1 if mode == "stage0" else layout.per_node if mode == "mics" else layout.dp
    optimizer_s = workload.shape.numel / tp / shards * cluster.optimizer_s_per_param
    step_s = (micro_steps - 1) * micro_step(False) + micro_step(True) + after_s + optimizer_s
    compute_s = micro_steps * (forward_s + backward_s)

    intra = inter = 0.0
    for t in transfers:
        a, e = t.link_bytes()
        repeat = micro_steps if t.per_micro_step else 1
        intra, inter = intra + a * repeat, inter + e * repeat
    state = model_state_bytes(mode, workload.shape.numel / tp, layout.dp, layout.per_node)
    return Prediction(
        mode=mode, world=world, step_s=step_s, compute_s=compute_s,
        exposed_comm_s=step_s - compute_s - optimizer_s, optimizer_s=optimizer_s,
        tokens_per_s_per_gpu=workload.tokens_per_rank / tp / step_s,
        mfu=workload.model_flops_per_rank / tp / step_s / (cluster.peak_tflops * 1e12),
        inter_bytes_per_gpu=inter, intra_bytes_per_gpu=intra, model_state_gb=state / 1e9,
        fits=state <= (1 - ACTIVATION_RESERVE) * cluster.memory_gb * 1e9)
