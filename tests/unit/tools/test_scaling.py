"""The scale model (zerodp.tools.plan.scaling): calibration against zerodp's measured steps, the byte formulas
of each mode, the overlap rule, the published checks, docs/scaling.md and `zerodp estimate --cluster`.
Pure arithmetic: milliseconds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from zerodp.tools.cli.main import main
from zerodp.tools.plan.scaling.calibration import BENCH_WORKLOAD, MEASURED, calibration_rows
from zerodp.tools.plan.scaling.cluster import H100_8X400G, LOCAL_GLOO
from zerodp.tools.plan.scaling.plan import Group, Kind, Layout, Phase, Transfer, plan
from zerodp.tools.plan.scaling.predictor import predict
from zerodp.tools.plan.scaling.published import CHECKS
from zerodp.tools.plan.scaling.report import regenerate
from zerodp.tools.plan.scaling.workload import BENCH_GPT, LLAMA_7B, LLAMA_70B, Workload

DOC = Path(__file__).resolve().parents[3] / "docs" / "scaling.md"


def test_bench_gpt_shape_matches_the_benchmark():
    # baselines.md: N = 33,674,240 parameters, 29.36M in matmuls, 182.5 MFLOP per token
    assert BENCH_GPT.numel == 33_674_240
    assert BENCH_GPT.matmul_numel == 29_360_128
    assert BENCH_GPT.model_flops_per_token() == pytest.approx(182.45e6, rel=1e-3)
    assert LLAMA_7B.numel == pytest.approx(6.74e9, rel=1e-3) and LLAMA_70B.numel == pytest.approx(68.98e9, rel=1e-3)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_calibration_reproduces_measured_step_within_25_percent(stage):
    # The local spec comes from independent anchors (matmul rate, single-process step, gloo gather
    # bandwidth, overlap probe, optimizer bench); 25% is the brief's bound, and the machine's speed
    # wanders 10-15% between sessions (bench/RESULTS.md), so a tighter bound would test the weather.
    _, measured, predicted = next(r for r in calibration_rows() if r[0] == stage)
    assert abs(predicted.step_s / measured - 1) <= 0.25, (stage, predicted.step_s, measured)


def test_calibration_bytes_equal_the_bench_traffic_column():
    # bench/RESULTS.md "traffic MiB/step" is the paper's volume (each rank sends half of it at 2 ranks):
    # 256.8 MiB at stages 0-2, 368.8 at stage 3 (the head stays gathered into backward). Padding: 0.2%.
    traffic = {0: 256.8, 1: 256.8, 2: 256.8, 3: 368.8}
    for stage, _, p in calibration_rows():
        assert 2 * p.intra_bytes_per_gpu / 2**20 == pytest.approx(traffic[stage], rel=3e-3)


def test_calibration_orders_stage3_slowest_and_uses_the_measured_table():
    rows = {s: p.step_s for s, _, p in calibration_rows()}
    assert rows[3] > max(rows[0], rows[1], rows[2])
    assert MEASURED.step_s == {0: 1.461, 1: 1.412, 2: 1.439, 3: 1.600}
    assert BENCH_WORKLOAD.comm_bytes == 4 and BENCH_WORKLOAD.tokens_per_rank == 512


def test_ring_bytes_by_link_class():
    s = 1e9
    # 4 nodes x 8 GPUs: each rank sends (n-1)/n * S over NVLink; a node's NICs carry (m-1)/m * S, S/8 each
    ag = Transfer("ag", Kind.ALL_GATHER, s, Group(4, 8), Phase.FORWARD, 0.0, True)
    assert ag.link_bytes() == pytest.approx((31 / 32 * s, 3 / 4 * s / 8))
    ar = Transfer("ar", Kind.ALL_REDUCE, s, Group(4, 8), Phase.BACKWARD, 0.0, True)
    assert ar.link_bytes() == pytest.approx((2 * 31 / 32 * s, 2 * 3 / 4 * s / 8))
    inside = Transfer("ag", Kind.ALL_GATHER, s, Group(1, 8), Phase.FORWARD, 0.0, True)
    assert inside.link_bytes() == pytest.approx((7 / 8 * s, 0.0))
    # time: latency per hop + the slower link class
    seconds = ag.seconds(H100_8X400G)
    wire = max(31 / 32 * s / 450e9, 3 / 4 * s / 8 / 50e9) / 0.8
    assert seconds == pytest.approx(7 * 2e-6 + 3 * 5e-6 + wire)


def _inter(mode, world=1024, shape=LLAMA_70B):
    work = Workload(shape, 4096, micro_tokens=4096)
    return predict(mode, work, H100_8X400G, world).inter_bytes_per_gpu


def test_cross_node_volumes_follow_zero_plus_plus_table():
    psi_b, g, m = LLAMA_70B.numel * 2, 8, 128
    per_collective = (m - 1) / m * psi_b / g
    head = (m - 1) / m * LLAMA_70B.head_numel * 2 / g
    assert _inter("stage3") == pytest.approx(3 * per_collective - head)
    # hpZ: the backward gather stays in the node (2M); qwZ: forward gather about half; ZeRO++: 0.75M of 3M
    assert _inter("hpz") == pytest.approx(2 * per_collective)
    assert _inter("qwz") / _inter("stage3") == pytest.approx((0.5 + 2) / 3, abs=0.01)
    ratio = _inter("zeropp") / _inter("stage3")
    assert 0.24 < ratio <= 0.3, ratio   # the acceptance bound: <= 0.3x of ZeRO-3
    # MiCS/HSDP: only the all-reduce of each rank's 1/g gradient shard crosses nodes, over its own NIC:
    # 2M per node, as DDP, against ZeRO-3's 3M
    assert _inter("mics") == pytest.approx(2 * (m - 1) / m * psi_b / g)


def test_single_node_moves_nothing_across_nodes():
    for mode in ("stage0", "stage3", "zeropp", "mics"):
        assert _inter(mode, world=8, shape=LLAMA_7B) == 0.0


def test_overlap_rule_hides_short_communication_and_shows_long():
    work = Workload(LLAMA_7B, 4096, micro_tokens=4096)
    fast = predict("stage3", work, H100_8X400G, 64)
    # on 400 Gb/s the gathers fit under compute: only the unhidden units and the optimizer remain
    assert fast.exposed_comm_s < 0.02 * fast.step_s
    slow_cluster = H100_8X400G.with_overrides(inter_gb_per_s=1.0)
    slow = predict("stage3", work, slow_cluster, 64)
    transfers = plan("stage3", work, Layout.of(64, 8))
    comm = sum(t.seconds(slow_cluster) for t in transfers)
    # communication longer than compute: step = communication + the unhidden parts + optimizer
    assert slow.step_s >= comm and slow.step_s == pytest.approx(comm + slow.optimizer_s, rel=0.02)
    # no overlap at all (overlap 0): compute + all communication
    none = predict("stage3", work, H100_8X400G.with_overrides(overlap=0.0), 64)
    assert none.step_s == pytest.approx(fast.compute_s + sum(t.seconds(H100_8X400G) for t in transfers)
                                        + none.optimizer_s)


def test_stage12_gather_after_the_step_is_never_hidden():
    work = Workload(LLAMA_7B, 4096, micro_tokens=4096)
    p = predict("stage2", work, H100_8X400G, 1024)
    gather = next(t for t in plan("stage2", work, Layout.of(1024, 8)) if t.phase is Phase.AFTER)
    assert p.exposed_comm_s >= gather.seconds(H100_8X400G)


def test_bad_layouts_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="whole number of 8-GPU nodes"):
        Layout.of(12, 8)
    with pytest.raises(ValueError, match="multiple of the micro-batch"):
        Workload(LLAMA_7B, 1000, micro_tokens=4096)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name.split(",")[0])
def test_published_checks_as_documented(check):
    # docs/scaling.md says which checks land within 25%; the 100 Gb/s ZeRO++ speedup does not (explained there)
    _, error = check.evaluate()
    expected_within = not check.name.startswith("ZeRO++ over ZeRO-3, 384 V100, 100 Gb/s")
    assert (abs(error) <= 0.25) == expected_within, (check.name, error)


def test_scaling_doc_tables_are_current():
    text = DOC.read_text()
    assert regenerate(text) == text, \
        "docs/scaling.md is stale: python -m zerodp.tools.plan.scaling.report --write docs/scaling.md"
    # the blocks hold the tables (an empty block would regenerate to itself only if the code printed nothing)
    for row in ("| stage 3 | 1.600 |", "| llama-70b | 1024 | ZeRO++ |", "| ZeRO-100B, 400 V100",
                "| h100-8x100g-node | llama-70b | 1024 |", "| ZeRO-100B TFLOP/s/GPU |"):
        assert row in text, row


@pytest.mark.heavy  # seconds of CPU: left out of `make test-fast` (the edit loop), run by `make test`
def test_the_documented_regenerate_command_runs(tmp_path):
    """docs/scaling.md's `python -m ... --write docs/scaling.md` is a command a developer types: run it as
    written on a copy of the page (the module path moved once, with the planners into zerodp.tools.plan)."""
    text = DOC.read_text()
    module = re.search(r"`python -m (\S+) --write docs/scaling\.md`", text).group(1)
    copy = tmp_path / "scaling.md"
    copy.write_text(text)
    done = subprocess.run([sys.executable, "-m", module, "--write", str(copy)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert copy.read_text() == text and f"regenerated {copy}" in done.stdout


def test_regenerate_refuses_a_missing_block():
    with pytest.raises(ValueError, match="expected each of"):
        regenerate("<!-- generated:calibration -->\n<!-- end:calibration -->\n")


def test_estimate_cluster_prints_predictions(capsys):
    assert main(["estimate", "--cluster", "h100-8x400g", "--model-size", "70b", "--gpus", "64,1024",
                 "--modes", "stage3,zeropp"]) == 0
    out = capsys.readouterr().out
    assert "h100-8x400g" in out and "llama-70b" in out and "ZeRO++" in out
    rows = [line for line in out.splitlines() if line.startswith("llama-70b")]
    assert len(rows) == 4
    expected = predict("zeropp", Workload(LLAMA_70B, 4096, checkpointing=True, micro_tokens=4096), H100_8X400G, 1024)
    assert f"{expected.step_s:.3f}" in rows[3]


def test_estimate_cluster_overrides_and_errors(capsys):
    assert main(["estimate", "--cluster", "h100-8x400g", "--model-size", "13B", "--gpus", "16",
                 "--inter-gbps", "100", "--modes", "stage3"]) == 0
    assert "inter 12.5 GB/s" in capsys.readouterr().out
    for argv, needle in ((["--modes", "stage9"], "unknown stage9"), (["--gpus", "12"], "split evenly over 12"),
                         (["--model-size", "5M"], "at least 1e8"), (["--efficiency", "1.5"], "--efficiency"),
                         (["--world-size", "64"], "--world-size only apply to the memory estimate"),
                         (["--micro-tokens", "0"], "--micro-tokens must be > 0")):
        assert main(["estimate", "--cluster", "h100-8x400g", *argv]) == 2
        assert needle in capsys.readouterr().err
    # and the cluster options are not silently ignored by the memory estimate
    assert main(["estimate", "--params", "7e9", "--gpus", "64"]) == 2
    assert "--gpus only apply to --cluster" in capsys.readouterr().err


def test_model_state_memory_per_mode():
    psi, work = LLAMA_7B.numel, Workload(LLAMA_7B, 4096, micro_tokens=4096)
    gb = {m: predict(m, work, H100_8X400G, 64).model_state_gb * 1e9 for m in ("stage0", "stage1", "stage2",
                                                                             "stage3", "hpz", "mics")}
    assert gb["stage0"] == pytest.approx(16 * psi)
    assert gb["stage1"] == pytest.approx(4 * psi + 12 * psi / 64)
    assert gb["stage2"] == pytest.approx(2 * psi + 14 * psi / 64)
    assert gb["stage3"] == pytest.approx(16 * psi / 64)
    assert gb["hpz"] == pytest.approx(16 * psi / 64 + 2 * psi / 8)     # + the secondary bf16 shard
    assert gb["mics"] == pytest.approx(16 * psi / 8)                   # sharded within the 8-GPU node


def test_tensor_parallel_term_and_its_data_parallel_group():
    from zerodp.tools.plan.scaling.cluster import dgx2_v100
    from zerodp.tools.plan.scaling.plan import tensor_parallel_transfers
    from zerodp.tools.plan.scaling.published import GPT_100B

    work = Workload(GPT_100B, 16 * 1024, checkpointing=True)
    layout = Layout.of(400, 16, tp=16)
    assert (layout.dp, layout.nodes, layout.per_node) == (25, 25, 1)
    fwd, bwd = tensor_parallel_transfers(work, layout, 16 * 1024)
    act = 16 * 1024 * 8192 * 2
    # two all-reduces per layer forward, four backward (two for the recomputed forward), 2(n-1)/n each
    assert fwd.link_bytes() == pytest.approx((2 * 15 / 16 * 2 * 125 * act, 0.0))
    assert bwd.link_bytes() == pytest.approx((2 * 15 / 16 * 4 * 125 * act, 0.0))
    # ZeRO-2's gradient reduce-scatter runs between nodes only, over the 1/16 slice each GPU holds
    rs = plan("stage2", work, layout)[0]
    assert rs.link_bytes() == pytest.approx((0.0, 24 / 25 * GPT_100B.numel / 16 * 2))
    assert predict("stage2", work, dgx2_v100(800), 400, tp=16).model_state_gb < 32


def test_model_size_counts_give_llama_like_shapes():
    from zerodp.tools.plan.scaling.workload import shape_for_count

    for count in (1e8, 13e9, 175e9):
        assert shape_for_count(count).numel == pytest.approx(count, rel=0.03)
    with pytest.raises(ValueError, match="at least 1e8"):
        shape_for_count(5e6)
