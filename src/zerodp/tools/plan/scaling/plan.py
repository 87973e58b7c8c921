"""The communication plan of one training step, per mode, by link class.

Pure arithmetic. A mode is a list of `Transfer`s: one collective's buffer (bytes), the group it runs
over (how many ranks, spread over how many nodes), the phase whose compute it may hide behind,
how much of it the schedule cannot hide, and whether it repeats every micro-step.

Bytes one rank moves, for a buffer of S bytes (the all-gather's output, the reduce-scatter's input,
the all-reduce's tensor) over a group of n = m * k ranks on m nodes, k per node, as NCCL's rings
run it (one ring per NIC rail, each entering a node once):

    all-gather / reduce-scatter:  intra = (n-1)/n * S        inter = (m-1)/m * S / k
    all-reduce:                   twice that (a reduce-scatter, then an all-gather)
    all-to-all (one hop):         intra = (k-1)/k * S  (m = 1)   inter = (m-1)/m * S  (k = 1)

(A node's NICs carry (m-1)/m * S in all, shared by its k ranks: this is why cross-node volume is
usually quoted per node, "3M" in the ZeRO++ paper, and why it is S/k per GPU here.) Latency: a ring
takes k-1 intra-node and m-1 inter-node hops; an all-to-all one hop; each unit (a layer, the
embedding, the head: layers + 2 calls) pays it once.

Modes (Psi parameters, b bytes per communicated element, g GPUs per node, L = one layer's share
of Psi, the unit whose collective cannot be hidden; ZeRO++ = Wang et al. 2023, arXiv 2306.10209):

    stage0   all-reduce Psi*b of gradients, once per step, in the last micro-step's backward
    stage1   reduce-scatter Psi*b once per step (backward); all-gather Psi*b of updated params after
             the optimizer step (nothing left to hide it behind)
    stage2   as stage1, but the reduce-scatter runs every micro-step (gradients are sharded)
    stage3   every micro-step: all-gather Psi*b in forward, (Psi - head)*b in backward (the last
             forward unit stays gathered), reduce-scatter Psi*b in backward
    hpz      stage3 whose backward all-gather runs inside the node (secondary shards, group k = g)
    qwz      stage3 whose forward all-gather moves int8 + one fp32 scale per 512 elements
    qgz      stage3 whose reduce-scatter is int4 (+ scales) through a hierarchical all-to-all: inside
             the node, then across nodes between the GPUs of equal local rank, each with 1/g of it
    zeropp   hpz + qwz + qgz
    mics     (= HSDP) stage3 sharded within each node (k = g, m = 1), then an all-reduce of each
             rank's Psi*b/g gradient shard across the m nodes (one rank per node), every step
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .cluster import ClusterSpec
from .workload import Workload

QWZ_BYTES_PER_ELEMENT = 1 + 4 / 512     # int8 + an fp32 scale per 512-element block
QGZ_BYTES_PER_ELEMENT = 0.5 + 4 / 512   # int4 + an fp32 scale per 512-element block


class Phase(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    AFTER = "after"          # after backward, before/after the optimizer: nothing to hide behind


class Kind(str, Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"


@dataclass(frozen=True)
class Group:
    """n = nodes * per_node ranks."""
    nodes: int
    per_node: int

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node


@dataclass(frozen=True)
class Transfer:
    name: str
    kind: Kind
    buffer_bytes: float
    group: Group
    phase: Phase
    exposed_fraction: float      # the part the schedule cannot overlap (first/last unit); 1 = blocking
    per_micro_step: bool
    collectives: int = 1         # how many calls it is split into (one per unit): each pays the latency

    def link_bytes(self) -> tuple[float, float]:
        """(intra, inter) bytes one rank sends for this transfer (the module docstring's formulas)."""
        n, m, k, s = self.group.ranks, self.group.nodes, self.group.per_node, self.buffer_bytes
        if n <= 1:
            return 0.0, 0.0
        if self.kind is Kind.ALL_TO_ALL:
            return ((k - 1) / k * s if k > 1 else 0.0), ((m - 1) / m * s if m > 1 else 0.0)
        times = 2.0 if self.kind is Kind.ALL_REDUCE else 1.0
        intra = (n - 1) / n * s if k > 1 else 0.0
        inter = (m - 1) / m * s / k if m > 1 else 0.0
        return times * intra, times * inter

    def hops(self) -> tuple[int, int]:
        n, m, k = self.group.ranks, self.group.nodes, self.group.per_node
        if n <= 1:
            return 0, 0
        if self.kind is Kind.ALL_TO_ALL:
            return (1, 0) if m == 1 else (0, 1)
        times = 2 if self.kind is Kind.ALL_REDUCE else 1
        return times * (k - 1), times * (m - 1)

    def seconds(self, cluster: ClusterSpec) -> float:
        intra, inter = self.link_bytes()
        intra_hops, inter_hops = self.hops()
        return cluster.transfer_seconds(intra, inter, self.collectives * intra_hops, self.collectives * inter_hops)


MODES = ("stage0", "stage1", "stage2", "stage3", "hpz", "qwz", "qgz", "zeropp", "mics")
MODE_TITLES = {"stage0": "ZeRO-0 (DDP)", "stage1": "ZeRO-1", "stage2": "ZeRO-2", "stage3": "ZeRO-3",
               "hpz": "ZeRO-3 + hpZ", "qwz": "ZeRO-3 + qwZ", "qgz": "ZeRO-3 + qgZ", "zeropp": "ZeRO++",
               "mics": "MiCS / HSDP"}


@dataclass(frozen=True)
class Layout:
    """Where the data-parallel ranks sit: `dp` ranks over `nodes` nodes, `per_node` on each (a
    tensor-parallel group of `tp` GPUs inside a node is one data-parallel rank)."""
    dp: int
    nodes: int
    per_node: int
    tp: int

    @classmethod
    def of(cls, world: int, gpus_per_node: int, tp: int = 1) -> "Layout":
        if world < 1 or tp < 1 or world % tp:
            raise ValueError(f"world size {world} must be a positive multiple of the tensor-parallel degree {tp}")
        if world > gpus_per_node and world % gpus_per_node:
            raise ValueError(f"world size {world} is not a whole number of {gpus_per_node}-GPU nodes")
        if gpus_per_node % tp:
            raise ValueError(f"tensor-parallel degree {tp} must divide the {gpus_per_node} GPUs of a node")
        nodes = max(1, world // gpus_per_node)
        return cls(dp=world // tp, nodes=nodes, per_node=world // tp // nodes, tp=tp)

    @property
    def everyone(self) -> Group:
        return Group(self.nodes, self.per_node)

    @property
    def in_node(self) -> Group:
        return Group(1, self.per_node)

    @property
    def across_nodes(self) -> Group:
        return Group(self.nodes, 1)


def plan(mode: str, workload: Workload, layout: Layout) -> list[Transfer]:
    """The transfers of `mode` for one step (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    shape, b = workload.shape, workload.comm_bytes
    psi = shape.numel / layout.tp                 # what this data-parallel rank's TP slice holds
    unit = shape.layer_numel / shape.numel        # the share of one layer: the unhidden collective
    calls = shape.layers + 2                      # one collective per unit: embedding, layers, head
    everyone = layout.everyone
    F, B, A = Phase.FORWARD, Phase.BACKWARD, Phase.AFTER
    AG, RS, AR, A2A = Kind.ALL_GATHER, Kind.REDUCE_SCATTER, Kind.ALL_REDUCE, Kind.ALL_TO_ALL

    if mode == "stage0":
        return [Transfer("grad all-reduce", AR, psi * b, everyone, B, unit, False, calls)]
    if mode in ("stage1", "stage2"):
        return [Transfer("grad reduce-scatter", RS, psi * b, everyone, B, unit, mode == "stage2", calls),
                Transfer("param all-gather", AG, psi * b, everyone, A, 1.0, False, calls)]

    back_numel = psi - shape.head_numel / layout.tp
    if mode == "mics":
        node = layout.in_node
        return [Transfer("fwd param all-gather (node)", AG, psi * b, node, F, unit, True, calls),
                Transfer("bwd param all-gather (node)", AG, back_numel * b, node, B, unit, True, calls),
                Transfer("grad reduce-scatter (node)", RS, psi * b, node, B, unit, True, calls),
                Transfer("grad all-reduce (replicas)", AR, psi * b / layout.per_node, layout.across_nodes, B,
                         unit, False, calls)]
    quant_w = mode in ("qwz", "zeropp")
    quant_g = mode in ("qgz", "zeropp")
    secondary = mode in ("hpz", "zeropp")
    transfers = [
        Transfer("fwd param all-gather" + (" int8" if quant_w else ""), AG,
                 psi * (QWZ_BYTES_PER_ELEMENT if quant_w else b), everyone, F, unit, True, calls),
        Transfer("bwd param all-gather" + (" (node, hpZ)" if secondary else ""), AG, back_numel * b,
                 layout.in_node if secondary else everyone, B, unit, True, calls)]
    if quant_g:
        grads = psi * QGZ_BYTES_PER_ELEMENT
        transfers += [Transfer("grad all-to-all int4 (node)", A2A, grads, layout.in_node, B, unit, True, calls),
                      Transfer("grad all-to-all int4 (nodes)", A2A, grads / layout.per_node, layout.across_nodes,
                               B, unit, True, calls)]
    else:
        transfers.append(Transfer("grad reduce-scatter", RS, psi * b, everyone, B, unit, True, calls))
    return transfers


def tensor_parallel_transfers(workload: Workload, layout: Layout, micro_tokens: int) -> list[Transfer]:
    """Megatron-style tensor parallelism inside a node (the ZeRO paper's ZeRO-100B): per layer and
    micro-step, two all-reduces of the activations (tokens x hidden) in forward and two in backward
    (two more when checkpointing re-runs the forward), blocking: the next matmul needs the result."""
    if layout.tp == 1:
        return []
    shape = workload.shape
    act = micro_tokens * shape.hidden * workload.comm_bytes
    group = Group(1, layout.tp)
    back = 4 if workload.checkpointing else 2
    return [Transfer("tp activation all-reduce (fwd)", Kind.ALL_REDUCE, 2 * shape.layers * act, group,
                     Phase.FORWARD, 1.0, True, 2 * shape.layers),
            Transfer("tp activation all-reduce (bwd)", Kind.ALL_REDUCE, back * shape.layers * act, group,
                     Phase.BACKWARD, 1.0, True, back * shape.layers)]
