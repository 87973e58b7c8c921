"""`zerodp estimate --cluster NAME ...`: the options and the command that prints the scale model's
predictions (cli/main.py registers them and calls `run`)."""

from __future__ import annotations

import argparse

from ....errors import UsageError
from .cluster import CLUSTERS
from .plan import MODES
from .report import GLOBAL_TOKENS, HEADER, MICRO_TOKENS, prediction_cells, cluster_line, grid, text_table
from .workload import SIZE_ALIASES, parse_count, shape_for_count


def add_cluster_options(parser: argparse.ArgumentParser, choice) -> None:
    """`choice` is estimate's mutually exclusive group (--params / --model / --paper / --cluster)."""
    choice.add_argument("--cluster", choices=sorted(CLUSTERS), help="predict step time, tokens/s and MFU of "
                        "each mode on this cluster (docs/scaling.md); local-gloo is this machine")
    g = parser.add_argument_group("with --cluster")
    g.add_argument("--model-size", metavar="LIST", help="comma list of 7b, 70b (Llama-2 "
                   "shapes), 8b (Llama-3.1) or a parameter count such as 13B (a Llama-like shape; default 7b,70b)")
    g.add_argument("--gpus", metavar="LIST", help="comma list of GPU counts (whole nodes "
                   "above one node; default 8,64,1024)")
    g.add_argument("--modes", metavar="LIST", help=f"comma list of {', '.join(MODES)} "
                   "(default all)")
    g.add_argument("--global-tokens", type=int, metavar="T", help="tokens per optimizer "
                   f"step over all GPUs (default {GLOBAL_TOKENS})")
    g.add_argument("--micro-tokens", type=int, metavar="T", help="tokens per GPU per "
                   f"micro-step; the rest is gradient accumulation (default {MICRO_TOKENS})")
    g.add_argument("--no-checkpointing", action="store_true", default=None, help="no activation recomputation (default: full "
                   "checkpointing, the forward runs twice)")
    g.add_argument("--gpus-per-node", type=int, metavar="G", help="override the cluster's GPUs per node")
    g.add_argument("--intra-gbps", type=float, metavar="GBIT", help="override the intra-node link: Gb/s "
                   "(gigabits) per GPU one way (NVLink 4: 3600)")
    g.add_argument("--inter-gbps", type=float, metavar="GBIT", help="override the inter-node link: Gb/s "
                   "(gigabits) per GPU one way (a 400G NIC per GPU: 400)")
    g.add_argument("--tflops", type=float, metavar="F", help="override the peak dense TFLOP/s per GPU")
    g.add_argument("--efficiency", type=float, metavar="E", help="override the fraction of peak one step's "
                   "kernels reach (0-1)")


def _list(text: str, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise UsageError(f"{what} is empty")
    return items


def _shape(text: str):
    if text.lower() in SIZE_ALIASES:
        return SIZE_ALIASES[text.lower()]

    try:
        return shape_for_count(parse_count(text))
    except (UsageError, ValueError) as err:
        raise UsageError(f"--model-size {text!r}: use 7b, 70b, 8b or a count of at least 1e8 such as 13B "
                         f"({err})") from None


CLUSTER_ONLY = ("model_size", "gpus", "modes", "global_tokens", "micro_tokens", "no_checkpointing",
                "gpus_per_node", "intra_gbps", "inter_gbps", "tflops", "efficiency")
MEMORY_ONLY = ("world_size", "stage", "precision", "offload", "offload_param", "seq_len")


def refuse_unused_options(ns: argparse.Namespace) -> None:
    """An option the chosen estimate ignores is a mistake, not a no-op: name it."""
    unused = MEMORY_ONLY if ns.cluster is not None else CLUSTER_ONLY
    given = ["--" + name.replace("_", "-") for name in unused if getattr(ns, name, None) is not None]
    if given:
        where = "the memory estimate (--params/--model/--paper)" if ns.cluster is not None else "--cluster"
        raise UsageError(f"{', '.join(given)} only apply to {where}; drop them or choose that estimate")


def run(ns: argparse.Namespace) -> int:
    """Print the cluster, the workload and the prediction table."""
    defaults = {"model_size": "7b,70b", "gpus": "8,64,1024", "modes": ",".join(MODES),
                "global_tokens": GLOBAL_TOKENS, "micro_tokens": MICRO_TOKENS, "no_checkpointing": False}
    ns = argparse.Namespace(**{**vars(ns), **{k: v for k, v in defaults.items() if getattr(ns, k) is None}})
    for name, value, low, high in (("--efficiency", ns.efficiency, 0, 1), ("--tflops", ns.tflops, 0, None),
                                   ("--intra-gbps", ns.intra_gbps, 0, None), ("--inter-gbps", ns.inter_gbps, 0, None),
                                   ("--gpus-per-node", ns.gpus_per_node, 0, None),
                                   ("--global-tokens", ns.global_tokens, 0, None),
                                   ("--micro-tokens", ns.micro_tokens, 0, None)):
        if value is not None and (value <= low or (high is not None and value > high)):
            raise UsageError(f"{name} must be > {low}" + (f" and <= {high}" if high else "") + f", got {value}")
    cluster = CLUSTERS[ns.cluster].with_overrides(
        gpus_per_node=ns.gpus_per_node, peak_tflops=ns.tflops, compute_efficiency=ns.efficiency,
        intra_gb_per_s=None if ns.intra_gbps is None else ns.intra_gbps / 8,
        inter_gb_per_s=None if ns.inter_gbps is None else ns.inter_gbps / 8)
    modes = _list(ns.modes, "--modes")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise UsageError(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    try:
        worlds = tuple(int(w) for w in _list(ns.gpus, "--gpus"))
    except ValueError:
        raise UsageError(f"--gpus {ns.gpus!r}: a comma list of GPU counts, e.g. 8,64,1024") from None
    shapes = tuple(_shape(s) for s in _list(ns.model_size, "--model-size"))
    try:
        rows = grid(cluster, shapes, worlds, tuple(modes), ns.global_tokens, ns.micro_tokens,
                    not ns.no_checkpointing)
    except ValueError as err:
        raise UsageError(str(err)) from None
    print(cluster_line(cluster))
    print(f"workload: {ns.global_tokens:,} tokens per step, {ns.micro_tokens:,} per GPU per micro-step, bf16 "
          f"collectives, mixed-precision Adam, {'no' if ns.no_checkpointing else 'full'} activation checkpointing; "
          + "; ".join(f"{s.name}: {s.numel / 1e9:.2f}B params, {s.model_flops_per_token() / 1e9:.1f} GFLOP/token"
                      for s in shapes))
    print(text_table(HEADER, [prediction_cells(s, p) for s, p in rows]))
    print("model: docs/scaling.md (compute at peak x efficiency; each collective latency + bytes / link "
          "bandwidth; overlap as the schedule allows)")
    return 0
