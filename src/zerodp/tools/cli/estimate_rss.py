"""`zerodp estimate --peak-rss | --config FILE | --fit-memory BUDGET`: each rank's peak RSS before launch.

This module owns those options, how they become a model shape and a run shape (plan/model_shape.py),
and the two printouts: the peak's terms (plan/peak_rss.py) and the fit table (plan/fit.py). The
baseline RSS of the framework comes from plan/baseline.py (measured once per machine and cached)
unless `--baseline-rss` gives it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Optional

from ...errors import ConfigError, UsageError

PEAK_OPTIONS = ("config", "peak_rss", "fit_memory", "layers", "activation_bytes", "gpt", "calibrate", "baseline_rss")


def add_peak_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("peak RSS per rank (with --model or --params)")
    g.add_argument("--peak-rss", action="store_true", default=None, help="predict each rank's peak RSS: the "
                   "framework's measured baseline, model states by tier, offload I/O buffers, activations, gathered "
                   "units, gradient buffers and heap retention (docs/memory.md)")
    g.add_argument("--config", metavar="FILE", help="a zerodp/DeepSpeed config (.json, .yaml) whose stage, "
                   "precision, micro-batch and offload sections the peak RSS is predicted for (implies --peak-rss; "
                   "--stage, --precision and --micro-batch override it)")
    g.add_argument("--fit-memory", metavar="BUDGET", help="name the cheapest configuration (stage, offload, "
                   "max_in_cpu) whose predicted peak RSS per rank fits BUDGET, e.g. 8GiB, 500MiB, 16GB")
    g.add_argument("--layers", type=int, metavar="L", help="with --params: the model is L equal stage-3 units "
                   "(transformer blocks); required there for the peak RSS")
    g.add_argument("--activation-bytes", metavar="SIZE", help="with --params: bytes one micro-batch saves for "
                   "backward (e.g. 2GiB; default 0, stated in the output)")
    g.add_argument("--gpt", metavar="KEY=VALUE,...", help="with --model: override the preset's shape, e.g. "
                   "n_layer=37,n_embd=2560,n_head=20,vocab_size=32000,block_size=128,tie_embeddings=0")
    g.add_argument("--calibrate", action="store_true", default=None, help="measure the baseline RSS of this "
                   "machine again (a subprocess trains a tiny model; cached in ~/.cache/zerodp)")
    g.add_argument("--baseline-rss", metavar="SIZE", help="the baseline RSS per rank, instead of measuring it")


def wants_peak(ns: argparse.Namespace) -> bool:
    return bool(ns.peak_rss or ns.config or ns.fit_memory)


def refuse_misplaced(ns: argparse.Namespace) -> None:
    """The peak-RSS options need --model or --params, and theirs only; one line naming the fix."""
    given = ["--" + n.replace("_", "-") for n in PEAK_OPTIONS if getattr(ns, n, None) is not None]
    if given and ns.model is None and ns.params is None:
        raise UsageError(f"{', '.join(given)} need --model or --params (the model whose peak RSS is predicted)")
    if not wants_peak(ns) and any(getattr(ns, n) is not None for n in PEAK_OPTIONS[3:]):
        raise UsageError("--layers, --activation-bytes, --gpt, --calibrate and --baseline-rss apply to the peak "
                         "RSS estimate; add --peak-rss (or --config FILE, or --fit-memory BUDGET)")
    if ns.params is not None and (ns.gpt is not None):
        raise UsageError("--gpt overrides a --model preset's shape; with --params describe the model with --layers")
    if ns.model is not None and (ns.layers is not None or ns.activation_bytes is not None):
        raise UsageError("--layers and --activation-bytes describe a --params model; a --model preset has its own "
                         "(change its shape with --gpt)")


def _size(text: str, option: str) -> int:
    from ...checkpoint.hf_export import parse_size
    from ...errors import CheckpointError

    try:
        return parse_size(text)
    except CheckpointError as err:
        raise UsageError(f"{option}: {err}") from None


def _config(ns: argparse.Namespace):
    """The validated config: the file's keys (or none), with --stage / --precision / --micro-batch and the
    --offload options on top."""
    from ...config import load_config

    data = load_config(ns.config).model_dump(exclude_unset=True) if ns.config else {}
    zero = data.setdefault("zero_optimization", {})
    if ns.stage is not None:
        zero["stage"] = ns.stage
    elif "stage" not in zero:
        zero["stage"] = 3
    # as the model-state table: mixed precision by default with --params, fp32 with --model (as `zerodp train`)
    precision = ns.precision or (None if ns.model is not None or ns.config else "mixed")
    if precision is not None:
        data["bf16"], data["fp16"] = {"enabled": precision == "mixed"}, {"enabled": False}
    for option, key in (("offload", "offload_optimizer"), ("offload_param", "offload_param")):
        device = getattr(ns, option)
        if device is not None:
            zero[key] = {**zero.get(key, {}), "device": device}
            zero[key].setdefault("nvme_path", "/estimate")  # where the files would go does not change memory
    if ns.max_in_cpu is not None:
        zero.setdefault("offload_param", {})["max_in_cpu"] = int(ns.max_in_cpu)
    if ns.sub_group_size is not None:
        zero["sub_group_size"] = int(ns.sub_group_size)
    if ns.buffer_count is not None:
        zero.setdefault("offload_optimizer", {})["buffer_count"] = ns.buffer_count
    if ns.micro_batch is not None:
        data["train_micro_batch_size_per_gpu"] = ns.micro_batch
    if ns.offload_param is not None and zero["stage"] != 3:  # the config layer would drop it with a warning
        raise UsageError(f"--offload-param needs stage 3 (only stage 3 partitions parameters), but stage is "
                         f"{zero['stage']}; pass --stage 3 or drop --offload-param")
    from ...config.offload import check_stage

    try:
        config = load_config(data)
        zero = config.zero_optimization
        check_stage(zero.stage, zero.offload_optimizer, zero.offload_param)  # as the engine checks at start-up
    except (ConfigError, ValueError) as err:
        raise UsageError(f"{ns.config or 'the options'}: {err}") from None
    return config


def _gpt_config(ns: argparse.Namespace):
    from ..models.gpt import MODEL_PRESETS

    cfg = MODEL_PRESETS[ns.model]
    if not ns.gpt:
        return cfg
    fields = {f.name: f.type for f in dataclasses.fields(cfg)}
    updates = {}
    for item in ns.gpt.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in fields or not value.strip():
            raise UsageError(f"--gpt {item!r}: write KEY=VALUE with KEY one of {', '.join(fields)}")
        try:
            updates[key] = bool(int(value)) if key == "tie_embeddings" else int(value)
        except ValueError:
            raise UsageError(f"--gpt {item!r}: {value!r} is not an integer") from None
    return dataclasses.replace(cfg, **updates)


def shapes(ns: argparse.Namespace):
    """(ModelShape, RunShape, config, a line describing the model) from the options."""
    import torch

    from ..app.train_args import DEFAULT_MICRO_BATCH
    from ..plan.model_shape import gpt_shape, run_shape_of, uniform_shape
    from ..plan.scaling.workload import parse_count

    config = _config(ns)
    world = ns.world_size or (2 if ns.model is not None else 64)  # as the model-state table
    if world < 1:
        raise UsageError(f"--world-size must be at least 1, got {world}")
    try:  # train_batch_size alone (DeepSpeed's way) gives the micro-batch through the world size
        micro = config.resolve_batch(world)[1] if (config.train_batch_size or config.train_micro_batch_size_per_gpu) \
            else DEFAULT_MICRO_BATCH
    except ConfigError as err:
        raise UsageError(f"{ns.config or 'the options'}: {err}") from None
    run = run_shape_of(config, world, ns.optimizer, has_gpu=torch.cuda.is_available())
    if ns.model is not None:
        gpt = _gpt_config(ns)
        seq_len = ns.seq_len or gpt.block_size
        if not 1 <= seq_len <= gpt.block_size:
            raise UsageError(f"--seq-len must be in 1..{gpt.block_size}, the model's block_size")
        model = gpt_shape(gpt, config, micro, seq_len, run.param_bytes)
        what = f"GPT {ns.model}{' with ' + ns.gpt if ns.gpt else ''}: {model.numel:,} parameters, micro-batch " \
               f"{micro} x {seq_len} tokens"
    else:
        if ns.layers is None or ns.layers < 1:
            raise UsageError("the peak RSS of a --params model needs --layers L (its number of equal blocks, "
                             "each one stage-3 unit)")
        act = _size(ns.activation_bytes, "--activation-bytes") if ns.activation_bytes else 0
        model = uniform_shape(int(parse_count(ns.params)), ns.layers, act)
        what = f"{model.numel:,} parameters in {ns.layers} equal units, activations " + \
               (f"{act / 2**20:.1f} MiB per micro-batch" if act else "not given (0; pass --activation-bytes)")
    buffer_size = config.zero_optimization.offload_param.buffer_size
    if run.param_offload == "nvme" and buffer_size < -(-model.largest_param_numel // world):
        raise UsageError(f"zero_optimization.offload_param.buffer_size={buffer_size} elements cannot hold a shard of "
                         f"the largest parameter ({model.largest_param_numel} elements over {world} ranks); set "
                         f"buffer_size to at least {-(-model.largest_param_numel // world)}")
    return model, run, config, what


def _baseline(ns: argparse.Namespace) -> tuple[int, str]:
    if ns.baseline_rss is not None:
        return _size(ns.baseline_rss, "--baseline-rss"), "given with --baseline-rss"
    from ..plan.baseline import BaselineError, baseline_rss_bytes

    try:
        return baseline_rss_bytes(recalibrate=bool(ns.calibrate))
    except BaselineError as err:
        raise UsageError(str(err)) from None


def _mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def render_peak(peak, run, what: str, baseline_where: str) -> str:
    offload = ", ".join(f"{k} {v}" for k, v in (("offload_optimizer", run.optimizer_offload),
                                                 ("offload_param", run.param_offload)) if v != "none") or "no offload"
    lines = [f"peak RSS per rank, predicted before launch: {_mib(peak.total)}",
             f"  {what}; stage {run.stage}, {run.world_size} rank(s), {offload}; the peak sits at: {peak.moment}",
             "| term | per rank | formula |", "|---|---|---|"]
    lines += [f"| {t.name} | {_mib(t.bytes)} | {t.why} |" for t in peak.terms]
    lines.append(f"baseline: {baseline_where}")
    if peak.disk_bytes:
        lines.append(f"in files under nvme_path: {peak.disk_bytes / 1e9:.2f} GB per rank (not RSS)")
    lines += list(peak.notes)
    return "\n".join(lines)


def render_fit(result, what: str) -> str:
    from ..plan.fit import zero_section

    budget = result.budget_bytes
    lines = [f"fitting {_mib(budget)} of peak RSS per rank ({what}); candidates in order of cost per step:",
             "| candidate | predicted peak | fits | cost per step |", "|---|---|---|---|"]
    lines += [f"| {c.label} | {_mib(c.peak.total)} | {'yes' if c.fits else 'no'} | {c.cost} |"
              for c in result.candidates]
    chosen = result.chosen
    if chosen is None:
        least = min(result.candidates, key=lambda c: c.peak.total)
        lines.append(f"nothing fits {_mib(budget)}: the least memory is {least.label} at {_mib(least.peak.total)}; "
                     f"add ranks (--world-size), shorten the micro-batch or raise the budget")
        return "\n".join(lines)
    before = [c for c in result.candidates[:result.candidates.index(chosen)]]
    why = (f"the cheapest candidates need more: " + ", ".join(f"{c.label} {_mib(c.peak.total)}" for c in before[-2:])
           if before else "it is the cheapest candidate")
    lines += [f"cheapest that fits: {chosen.label}, predicted peak {_mib(chosen.peak.total)} <= {_mib(budget)}; "
              f"{why}",
              "zero_optimization: " + json.dumps(zero_section(chosen.run))]
    if chosen.peak.disk_bytes:
        lines.append(f"nvme_path needs {chosen.peak.disk_bytes / 1e9:.2f} GB free per rank (a fast local disk)")
    return "\n".join(lines)


def run_peak(ns: argparse.Namespace) -> int:
    """Print the peak-RSS prediction, or the fit table with --fit-memory; returns the exit code."""
    from ..plan.fit import fit_memory
    from ..plan.peak_rss import predict_peak_rss

    budget: Optional[int] = _size(ns.fit_memory, "--fit-memory") if ns.fit_memory else None
    model, run, _, what = shapes(ns)
    baseline, where = _baseline(ns)
    if budget is None:
        print(render_peak(predict_peak_rss(model, run, baseline), run, what, where))
        return 0
    result = fit_memory(model, run, budget, baseline)
    print(render_fit(result, what))
    print(f"baseline: {_mib(baseline)}, {where}")
    return 0 if result.chosen is not None else 1
