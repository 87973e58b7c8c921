"""The peak-RSS model's arithmetic (plan/peak_rss.py, model_shape.py, fit.py, baseline.py's cache): no
process group, no subprocess, milliseconds."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from zerodp.config import load_config
from zerodp.tools.plan import baseline as baseline_mod
from zerodp.tools.plan.fit import fit_memory, zero_section
from zerodp.tools.plan.model_shape import module_shape, run_shape_of, uniform_shape
from zerodp.tools.plan.peak_rss import (HEAP_RETENTION_ACTIVATIONS, HEAP_RETENTION_STATES, REDUCTIONS_IN_FLIGHT,
                                    ModelShape, RunShape, predict_peak_rss)

MiB = 2**20
BASE = 300 * MiB


def _nvme(**extra) -> dict:
    return {"device": "nvme", "nvme_path": "/estimate", **extra}


def test_total_is_the_sum_of_its_terms_and_starts_at_the_baseline():
    peak = predict_peak_rss(uniform_shape(10_000_000, 10, 1e6), RunShape(world_size=2, stage=3), BASE)
    assert peak.term("baseline") == BASE
    assert peak.total == pytest.approx(sum(t.bytes for t in peak.terms))
    assert peak.total > BASE


def test_stage3_model_states_in_ram_are_the_paper_formula_plus_persistent():
    model = ModelShape(numel=1_000_000, unit_numels=(400_000, 400_000), persistent_numel=200_000)
    peak = predict_peak_rss(model, RunShape(world_size=4, stage=3), BASE)
    assert peak.term("parameters") == 4 * (800_000 / 4 + 200_000)  # persistent stay whole on every rank
    assert peak.term("gradients") == 4 * 800_000 / 4
    assert peak.term("optimizer states") == 8 * 1_000_000 / 4  # fp32 Adam: the master is the parameter
    assert peak.disk_bytes == 0


@pytest.mark.parametrize("stage, grads, optimizer", [(0, 4e6, 8e6), (1, 4e6, 4e6), (2, 2e6, 4e6)])
def test_stages_0_to_2_shard_what_the_paper_says(stage, grads, optimizer):
    peak = predict_peak_rss(uniform_shape(1_000_000, 1), RunShape(world_size=2, stage=stage), BASE)
    assert peak.term("parameters") == 4e6
    assert peak.term("gradients") == grads
    assert peak.term("optimizer states") == optimizer


def test_stage2_gradient_buffers_are_one_bucket_filling_and_two_in_reduction():
    run = RunShape(world_size=2, stage=2, reduce_bucket_size=1000)
    peak = predict_peak_rss(uniform_shape(1_000_000, 1), run, BASE)
    assert peak.term("gradient buffers") == 4 * 1000 * (1 + REDUCTIONS_IN_FLIGHT * 1.5)
    one_bucket = predict_peak_rss(uniform_shape(1000, 1), run, BASE)  # the whole model: nothing else in flight
    assert one_bucket.term("gradient buffers") == 4 * 1000


def test_optimizer_offload_moves_the_state_to_files_and_keeps_windows():
    run = RunShape(world_size=2, stage=3, optimizer_offload="nvme", sub_group_size=1000, optimizer_buffer_count=3)
    peak = predict_peak_rss(uniform_shape(1_000_000, 4), run, BASE)
    assert peak.term("optimizer states") == 0  # fp32: no separate master
    assert peak.term("optimizer I/O windows") == 3 * 1000 * 8
    assert peak.disk_bytes == 8 * 500_000
    # a shard of two windows never allocates more than two slots (offload/optimizer_state.py's pipeline)
    two_windows = predict_peak_rss(uniform_shape(2 * 1500, 1), run, BASE)
    assert two_windows.term("optimizer I/O windows") == 2 * 1000 * 8


def test_param_offload_caches_the_working_set_when_max_in_cpu_is_unset_and_honours_a_value():
    model = uniform_shape(1_000_000, 10)  # units of 100,000 elements: shards of 50,000
    unset = predict_peak_rss(model, RunShape(world_size=2, stage=3, param_offload="nvme", param_buffer_count=5), BASE)
    assert unset.term("parameters") == 4 * 5 * 50_000
    given = predict_peak_rss(model, RunShape(world_size=2, stage=3, param_offload="nvme", max_in_cpu=70_000), BASE)
    assert given.term("parameters") == 4 * 70_000
    # fp32: the gradient shards go to the files too ([Note: gradient shards offloaded]); mixed: they stay
    assert unset.term("gradients") == 0 and unset.disk_bytes == 2 * 4 * 500_000
    mixed = RunShape(world_size=2, stage=3, param_offload="nvme", param_bytes=2, grad_bytes=2, master_bytes=4)
    assert predict_peak_rss(model, mixed, BASE).term("gradients") == 2 * 500_000


def test_heap_retention_only_without_offload():
    model = uniform_shape(1_000_000, 4, activation_bytes=1e6)
    plain = predict_peak_rss(model, RunShape(world_size=2, stage=3), BASE)
    states = sum(plain.term(n) for n in ("parameters", "gradients", "optimizer states"))
    assert plain.term("heap retention") == pytest.approx(HEAP_RETENTION_STATES * states
                                                         + HEAP_RETENTION_ACTIVATIONS * 1e6)
    offloaded = predict_peak_rss(model, RunShape(world_size=2, stage=3, optimizer_offload="nvme"), BASE)
    assert offloaded.term("heap retention") == 0


def test_the_peak_moves_along_backward_when_the_gradient_cache_outgrows_the_activations():
    run = RunShape(world_size=2, stage=3, param_offload="nvme", max_in_cpu=10**9)
    big_activations = predict_peak_rss(uniform_shape(10_000_000, 10, activation_bytes=1e9), run, BASE)
    assert big_activations.moment == "backward of unit 10 of 10"  # where backward starts
    small_activations = predict_peak_rss(uniform_shape(10_000_000, 10, activation_bytes=1e3), run, BASE)
    assert small_activations.moment != big_activations.moment  # late in backward: the cache has filled
    assert small_activations.term("gradient shard cache") > big_activations.term("gradient shard cache") == 0


def test_run_shape_of_a_users_config_takes_the_engines_defaults():
    config = load_config({"zero_optimization": {"stage": 3, "offload_param": _nvme(), "offload_optimizer": _nvme()}})
    run = run_shape_of(config, 2)
    assert (run.max_in_cpu, run.sub_group_size, run.param_buffer_count, run.optimizer_buffer_count) == \
        (None, 4_000_000, 5, 4)
    assert (run.param_bytes, run.grad_bytes, run.master_bytes, run.state_bytes) == (4, 4, 0, 8)
    mixed = run_shape_of(load_config({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}), 2, "sgd")
    assert (mixed.param_bytes, mixed.master_bytes, mixed.state_bytes) == (2, 4, 4)
    cpu = run_shape_of(load_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}), 2)
    plain = dataclasses.replace(cpu, optimizer_offload="none")
    model = uniform_shape(1_000_000, 4, activation_bytes=1e6)
    with_cpu, without = predict_peak_rss(model, cpu, BASE), predict_peak_rss(model, plain, BASE)
    # device cpu: the state stays in host memory (a CPU rank's RSS), but large buffers are mapped (host_memory.py)
    assert with_cpu.term("optimizer states") == without.term("optimizer states") > 0
    assert with_cpu.term("heap retention") == 0 < without.term("heap retention")
    with pytest.raises(ValueError, match="unknown optimizer"):
        run_shape_of(config, 2, "rmsprop")


def test_module_shape_plans_the_engines_units():
    config = load_config({"zero_optimization": {"stage": 3}})
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(3)])
    shape = module_shape(model, config, activation_bytes=1e6)
    assert shape.unit_numels == (512 * 512,) * 3  # biases (512 < 100,000) stay whole on every rank
    assert shape.persistent_numel == 3 * 512 and shape.root_numel == 0
    assert shape.numel == 3 * (512 * 512 + 512)
    assert shape.unit_activation_share == pytest.approx(3 * 512 * 512 / shape.numel)


def test_fit_picks_the_first_candidate_in_cost_order_that_fits():
    model = uniform_shape(50_000_000, 10, activation_bytes=10 * MiB)
    run = RunShape(world_size=2, stage=0)
    peaks = {c.label: c.peak.total for c in fit_memory(model, run, 1e15, BASE).candidates}
    budget = (peaks["stage 2"] + peaks["stage 1"]) / 2
    result = fit_memory(model, run, budget, BASE)
    assert result.chosen.label == "stage 2"
    assert [c.fits for c in result.candidates[:3]] == [False, False, True]
    assert zero_section(result.chosen.run) == {"stage": 2}
    tight = fit_memory(model, run, peaks["stage 3 + offload_optimizer nvme"] + 1, BASE)
    assert tight.chosen.label == "stage 3 + offload_optimizer nvme"
    assert zero_section(tight.chosen.run)["offload_optimizer"]["device"] == "nvme"
    assert fit_memory(model, run, BASE, BASE).chosen is None  # the baseline alone fills it


def test_fit_orders_param_caches_from_largest_to_smallest():
    result = fit_memory(uniform_shape(400_000_000, 40), RunShape(world_size=2, stage=0), 1e15, BASE)
    caches = [c.peak.term("parameters") for c in result.candidates if c.run.param_offload == "nvme"]
    assert caches == sorted(caches, reverse=True) and len(caches) >= 3


def test_baseline_is_read_from_the_cache_for_this_machine_and_measured_otherwise(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERODP_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(baseline_mod, "measure_baseline_rss", lambda: calls.append(1) or 123 * MiB)
    assert baseline_mod.baseline_rss_bytes()[0] == 123 * MiB and len(calls) == 1
    assert baseline_mod.baseline_rss_bytes()[0] == 123 * MiB and len(calls) == 1  # cached
    cache = tmp_path / baseline_mod.CACHE_FILE
    saved = json.loads(cache.read_text())
    cache.write_text(json.dumps({**saved, "key": {**saved["key"], "torch": "0.0"}}))  # another torch
    baseline_mod.baseline_rss_bytes()
    assert len(calls) == 2
    cache.write_text("{not json")
    assert baseline_mod.baseline_rss_bytes()[0] == 123 * MiB and len(calls) == 3
    baseline_mod.baseline_rss_bytes(recalibrate=True)
    assert len(calls) == 4


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="world_size"):
        predict_peak_rss(uniform_shape(10, 1), RunShape(world_size=0, stage=3), BASE)
    with pytest.raises(ValueError, match="at least one"):
        uniform_shape(0, 1)
    with pytest.raises(ValueError, match="positive"):
        fit_memory(uniform_shape(10, 1), RunShape(world_size=1, stage=0), 0, BASE)
    assert dataclasses.replace(RunShape(world_size=1, stage=0), stage=3).stage == 3
