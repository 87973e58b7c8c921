"""ZeRO-R's activation memory: the formulas `zerodp estimate` prints (plan/activation_memory.py) against the
bytes zerodp's checkpointer keeps for the bundled GPT, and `zerodp train --checkpoint-activations`'s wiring and
summary line."""

from __future__ import annotations

import pytest
import torch

import zerodp
from zerodp.tools import cli
from zerodp.activations import DEVICE, HOST, Checkpointer
from zerodp.tools.app.report import render_summary
from zerodp.tools.app.train_args import resolve_train_args
from zerodp.config.activation_checkpointing import ActivationCheckpointingConfig as Settings
from zerodp.tools.plan.activation_memory import activation_memory, activation_rows
from zerodp.tools.models.gpt import GPT, MODEL_PRESETS, lm_loss

TINY = MODEL_PRESETS["tiny"]


def test_rows_fall_as_zero_r_says():
    b, t, d = 4, TINY.block_size, 2
    off, on, cpu, pa, pa_cpu = (mem for _, mem in activation_rows(TINY, b, t, d, tp=4))
    checkpoint_bytes = TINY.n_layer * b * t * TINY.n_embd * d  # one B*T*C per block
    assert on.kept_device == checkpoint_bytes and on.device < off.device
    assert (cpu.kept_device, cpu.kept_host) == (0, checkpoint_bytes)
    assert pa.kept_device == checkpoint_bytes / 4
    assert (pa_cpu.kept_device, pa_cpu.kept_host) == (0, checkpoint_bytes / 4)
    assert cpu.working == on.working == pa.working  # the recomputed block and the rest are not partitioned
    with pytest.raises(ValueError, match="switch checkpointing on"):
        activation_memory(TINY, b, t, d, cpu_checkpointing=True)


@pytest.mark.parametrize("keys", [{}, {"cpu_checkpointing": True}])
def test_kept_bytes_of_the_gpt_equal_the_formula(keys):
    model = GPT(TINY, seed=0)
    checkpointer = Checkpointer(Settings(**keys))
    model.checkpoint_fn = checkpointer.checkpoint
    idx = torch.randint(0, TINY.vocab_size, (3, TINY.block_size))
    lm_loss(model(idx), idx).backward()
    predicted = activation_memory(TINY, 3, TINY.block_size, 4, checkpointing=True, **keys)
    assert checkpointer.kept_bytes.peak == {DEVICE: predicted.kept_device, HOST: predicted.kept_host}


def test_estimate_prints_the_activation_table(capsys):
    code = cli.main(["estimate", "--model", "tiny", "--tp", "4"])
    out = capsys.readouterr().out
    assert code == 0
    assert "| + partition_activations (Pa, TP=4) |" in out and "| + cpu_checkpointing |" in out


def test_train_flag_adds_the_section_and_the_summary_shows_it(tmp_path):
    args = resolve_train_args({"checkpoint_activations": True, "out": str(tmp_path / "run"), "model": "tiny"})
    assert args.config["activation_checkpointing"] == {}
    assert zerodp.load_config(args.config).activation_checkpointing == Settings()
    plain = resolve_train_args({"out": str(tmp_path / "run2"), "model": "tiny", "overwrite": True})
    assert "activation_checkpointing" not in plain.config
    run = {"stage": 3, "world_size": 1, "model": "tiny", "numel": 1, "precision": "fp32", "first_step": 1,
           "last_step": 1, "tokens_per_s": 1.0, "step_time_s": 1.0, "initial_loss": 1.0, "final_loss": 1.0,
           "final_loss_window": 1, "val_loss": None, "checkpoint": None, "checkpoint_note": "-", "plot": None,
           "plot_note": "-", "out": "o", "wall_time_s": 1.0}
    rank = {"rank": 0, "params_bytes": 1, "params_bytes_predicted": 1, "grads_bytes": 1, "grads_bytes_predicted": 1,
            "optimizer_bytes": 1, "optimizer_bytes_predicted": 1, "peak_rss_bytes": 1,
            "activation_checkpointing": True, "activation_kept_device": 2048, "activation_kept_device_predicted": 2048,
            "activation_kept_host": 0, "activation_kept_host_predicted": 0, "activation_device_predicted": 4096,
            "activation_device_predicted_off": 8192}
    assert "device 2.00 KiB / 2.00 KiB" in render_summary(run, [rank])
    assert "8.00 KiB without checkpointing" in render_summary(run, [rank])


def test_tensor_parallel_rows_split_the_block_interiors():
    b, t = 2, TINY.block_size
    whole = activation_memory(TINY, b, t, 4, checkpointing=True)
    split = activation_memory(TINY, b, t, 4, checkpointing=True, tensor_parallel=2)
    assert split.kept_device == whole.kept_device  # block inputs are replicated on the TP ranks
    assert split.working < whole.working
    assert activation_memory(TINY, b, t, 4, checkpointing=True, tensor_parallel=2, partition_degree=2).kept_device \
        == whole.kept_device / 2
    with pytest.raises(ValueError, match="divide n_head"):
        activation_memory(TINY, b, t, 4, tensor_parallel=3)


def test_train_checkpoints_the_blocks_and_reports_the_kept_bytes(tmp_path):
    """One rank in process, 2 steps: the blocks run through the checkpointer (its kept bytes are measured, not
    zero) and equal the formula; the summary's activation figures come from this run."""
    from zerodp.tools.app.train import run_worker

    args = resolve_train_args({"checkpoint_activations": True, "out": str(tmp_path / "run"), "model": "tiny",
                               "nproc": 1, "steps": 2, "save_every": 0, "micro_batch": 2, "seq_len": 16})
    try:
        rank = run_worker(args)["ranks"][0]
    finally:
        zerodp.activations.PROCESS.checkpointer = None
    per_block = 2 * 16 * TINY.n_embd * 4
    assert rank["activation_kept_device"] == rank["activation_kept_device_predicted"] == TINY.n_layer * per_block
    assert rank["activation_device_predicted"] < rank["activation_device_predicted_off"]
