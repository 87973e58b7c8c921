"""Each rank's peak GPU memory, predicted: `torch.cuda.max_memory_allocated()` of a CUDA rank.

The same terms as the peak RSS (`peak_rss.py`), kept where they sit in device memory:

    peak = model states on the device     parameters, gradients, masters and optimizer states, less what
                                          offload keeps on the host (offload_optimizer: masters and states;
                                          offload_param: the stage-3 parameter shards)
         + working set at the peak        activations, gathered stage-3 units, gradient buffers

and none of the host's: no baseline (the CUDA context and torch's kernels are not allocations, so
`max_memory_allocated` never counts them), no heap retention (the caching allocator reuses freed blocks
and `max_memory_allocated` counts live tensors only), no offload I/O windows or shard caches (host
buffers). Temporaries of the optimizer step and the loss are not counted, as in the RSS model; the
prediction is for the training steps, before validation or generation gathers a stage-3 model whole.
Arithmetic on sizes only: no torch.
"""

from __future__ import annotations

from dataclasses import replace

from .peak_rss import ModelShape, PeakRss, RunShape, RssTerm, predict_peak_rss

# Terms of the RSS model that live in host memory on a GPU run, whatever the config says.
HOST_TERMS = ("baseline", "heap retention", "optimizer I/O windows", "gradient shard cache")


def _device_states(model: ModelShape, run: RunShape, term: RssTerm) -> RssTerm:
    """A model-state term of the RSS model, less the part offload keeps on the host."""
    if term.name == "optimizer states" and run.optimizer_offload != "none":
        return RssTerm(term.name, 0.0, f"on the host (offload_optimizer {run.optimizer_offload})")
    if term.name == "parameters" and run.stage == 3 and run.param_offload != "none":
        persistent = run.param_bytes * model.persistent_numel
        return RssTerm(term.name, persistent, f"{run.param_bytes} B x {model.persistent_numel:,} persistent elements; "
                                              f"the shards are on the host (offload_param {run.param_offload})")
    return term


def predict_peak_device_bytes(model: ModelShape, run: RunShape) -> PeakRss:
    """The peak device memory of one CUDA rank of `run` training `model` (module docstring)."""
    rss = predict_peak_rss(model, replace(run, has_gpu=False), baseline_bytes=0.0)
    terms = tuple(_device_states(model, run, t) for t in rss.terms if t.name not in HOST_TERMS)
    return PeakRss(tuple(t for t in terms if t.bytes or t.name == "activations"), rss.moment, rss.disk_bytes)
