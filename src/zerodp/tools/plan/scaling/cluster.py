"""The cluster spec: devices, their FLOP rate and the two link classes, with the cost of one transfer.

Link classes. Every byte a rank moves crosses either the intra-node link (NVLink/NVSwitch; on the
calibration machine, gloo over loopback) or the inter-node link (the NIC of each GPU: one
400 Gb/s rail per GPU on an H100 node). Bandwidths are per GPU and one way, in GB/s (1e9 bytes/s).

Cost of a transfer, the alpha-beta model:

    seconds = hops * latency + max(intra_bytes / intra_bw, inter_bytes / inter_bw) / link_efficiency

The two classes run at once (a ring pipelines through both), so the slower one sets the time;
`link_efficiency` is the fraction of the nominal bandwidth a collective library reaches on large
messages (nccl-tests' busbw over the link rate; stated per cluster). `hops` is the number of
sequential latency steps of the algorithm (a ring over n ranks: n - 1).

Compute: `peak_tflops` (the dense rate of the training dtype) times `compute_efficiency`, the
fraction of peak the kernels of one transformer step reach when nothing waits for communication
(an MFU-style factor, stated per cluster, not fitted to the published checks).

Overlap: `overlap` is the fraction of a collective that hides behind compute when the schedule
allows it to (predictor.py applies the rule). GPU collectives run on their own stream and copy
engines / SMs: 1.0. On the calibration machine gloo needs the same core as the matmuls: the
measured 5-10% (bench/results/calibration_machine.md), 0.08.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    gpus_per_node: int
    peak_tflops: float            # dense, per GPU, in the training dtype
    compute_efficiency: float     # fraction of peak one step's kernels reach
    intra_gb_per_s: float             # GB/s per GPU, one way, inside a node
    inter_gb_per_s: float             # GB/s per GPU, one way, across nodes (the GPU's NIC share)
    intra_latency_s: float        # per ring hop inside a node
    inter_latency_s: float        # per ring hop across nodes
    link_efficiency: float = 0.8  # achieved / nominal bandwidth of large collectives
    overlap: float = 1.0          # fraction of schedulable communication that hides behind compute
    optimizer_s_per_param: float = 1.5e-11   # one fp32 AdamW update of one element (memory bound)
    memory_gb: float = 80.0       # device memory, for the model-state fit check
    description: str = ""

    @property
    def effective_flops(self) -> float:
        """FLOP/s one device sustains on a training step."""
        return self.peak_tflops * 1e12 * self.compute_efficiency

    def transfer_seconds(self, intra_bytes: float, inter_bytes: float, intra_hops: int, inter_hops: int) -> float:
        """latency + bytes / bandwidth for the bytes one rank moves over each link class."""
        latency = intra_hops * self.intra_latency_s + inter_hops * self.inter_latency_s
        wire = max(intra_bytes / (self.intra_gb_per_s * 1e9),
                   inter_bytes / (self.inter_gb_per_s * 1e9) if inter_bytes else 0.0)
        return latency + wire / self.link_efficiency

    def with_overrides(self, **changes) -> "ClusterSpec":
        """A copy with some fields replaced (the CLI's --gpus-per-node, --intra-gbps, ...)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


# 8 x H100 SXM per node: NVLink 4 at 450 GB/s per GPU one way (900 GB/s bidirectional), one
# 400 Gb/s NIC per GPU (50 GB/s), bf16 dense peak 989 TFLOP/s. Latencies: about 2 us per NVLink hop
# and 5 us per InfiniBand hop (NCCL's LL128 protocol on large rings). compute_efficiency 0.40: what
# eager bf16 kernels of a 4k-8k-hidden transformer layer sustain (matmuls near 0.6-0.7 of peak,
# attention, norms and elementwise work well below); AdamW at 3.35 TB/s HBM, ~36 bytes per element.
H100_8X400G = ClusterSpec(
    "h100-8x400g", gpus_per_node=8, peak_tflops=989.0, compute_efficiency=0.40, intra_gb_per_s=450.0,
    inter_gb_per_s=50.0, intra_latency_s=2e-6, inter_latency_s=5e-6, link_efficiency=0.8, overlap=1.0,
    optimizer_s_per_param=36 / 3.35e12 / 0.7, memory_gb=80.0,
    description="8 x H100 SXM per node, NVLink 450 GB/s/GPU, 400 Gb/s NIC per GPU")
# The same nodes with a slow fabric: one 100 Gb/s NIC per node, shared by its 8 GPUs (1.5625 GB/s each),
# where the inter-node bytes decide everything.
H100_8X100G = H100_8X400G.with_overrides(
    name="h100-8x100g-node", inter_gb_per_s=100 / 8 / 8,
    description="8 x H100 per node, NVLink inside, one 100 Gb/s NIC per node")
# DGX-2 (16 x V100 32GB on NVSwitch, 150 GB/s per GPU one way; fp16 tensor-core peak 125 TFLOP/s),
# the machines of the ZeRO paper (800 Gb/s per node: 8 x 100 Gb/s InfiniBand) and of ZeRO++ (the
# same nodes with 1, 2, 4 or 8 of the 100 Gb/s links). Per GPU: node bandwidth / 16.
def dgx2_v100(node_gbit: float) -> ClusterSpec:
    return ClusterSpec(
        f"dgx2-v100-{int(node_gbit)}g", gpus_per_node=16, peak_tflops=125.0, compute_efficiency=0.40,
        intra_gb_per_s=150.0, inter_gb_per_s=node_gbit / 8 / 16, intra_latency_s=3e-6, inter_latency_s=6e-6,
        link_efficiency=0.8, overlap=1.0, optimizer_s_per_param=36 / 0.9e12 / 0.7, memory_gb=32.0,
        description=f"DGX-2: 16 x V100 32GB on NVSwitch, {node_gbit:g} Gb/s InfiniBand per node")


# The calibration machine (its measurements and the commands that made them: bench/results/calibration_machine.md):
# 2 ranks, one thread each, gloo over loopback, fp32. peak = the measured 1-thread fp32 matmul rate
# (102.9 GFLOP/s); compute_efficiency = the single-process step's fwd+bwd (2.18 s for
# 1024 tokens of 182.5 MFLOP) over that peak; link = zerodp's pairwise gloo
# exchange (comm/pairwise.py: 12/24 MiB gathered in 6-7/11-14 ms: each rank sends half at ~1.0 GB/s),
# latency from the 1 MiB all-gather (0.60 ms for 0.52 MB sent); overlap 0.08 (5-10% hidden);
# optimizer = zerodp's chunked step over torch's default AdamW, 0.250 s per 100M (bench/RESULTS.md).
LOCAL_GLOO = ClusterSpec(
    "local-gloo", gpus_per_node=2, peak_tflops=0.1029,
    compute_efficiency=(1024 * 182.452224e6 / 2.18) / 102.9e9, intra_gb_per_s=1.0, inter_gb_per_s=1.0,
    intra_latency_s=1e-4, inter_latency_s=1e-4, link_efficiency=1.0, overlap=0.08,
    optimizer_s_per_param=2.5e-9, memory_gb=24.0,
    description="this 2-core machine: 1 thread per rank, gloo loopback (measured)")

CLUSTERS = {c.name: c for c in (H100_8X400G, H100_8X100G, dgx2_v100(800), dgx2_v100(400), dgx2_v100(100),
                                LOCAL_GLOO)}
