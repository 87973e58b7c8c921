"""zerodp bench's bookkeeping (bench/runner.py), on made-up runs: no process is started."""

import argparse

from bench.harness import runner


def fake_run(name: str, step_s: float, losses=(3.0, 2.5)) -> list[dict]:
    """One run of `name` on 2 ranks whose timed steps all took `step_s` seconds."""
    rank = {"strategy": name, "world_size": 2, "losses": list(losses), "step_times": [9.0, 9.0, step_s, step_s],
            "model_state_bytes": {"params": 2 ** 20}, "predicted_state_bytes": {"params": 2 ** 20},
            "peak_live_bytes": 2 ** 21, "peak_rss_bytes": 2 ** 22, "traffic_bytes_per_step": None}
    return [rank, dict(rank)]


def test_ratios_are_per_round_medians_and_the_peer_is_the_fastest():
    # round 2 ran on a machine twice as slow: per-round ratios cancel that, a ratio of medians would not
    runs = {"ddp": [fake_run("ddp", 1.0), fake_run("ddp", 2.0), fake_run("ddp", 1.0)],
            "fsdp1_full": [fake_run("fsdp1_full", 1.2), fake_run("fsdp1_full", 2.4), fake_run("fsdp1_full", 1.2)],
            "fsdp2": [fake_run("fsdp2", 1.5), fake_run("fsdp2", 3.0), fake_run("fsdp2", 1.5)],
            "zerodp3": [fake_run("zerodp3", 1.1), fake_run("zerodp3", 2.2), fake_run("zerodp3", 1.1)]}
    rows = runner.aggregate(runs, micro_batch=4, seq=128)
    assert rows["zerodp3"]["x_ddp"] == 1.1
    name, ratio = rows["zerodp3"]["vs_peer"]
    assert name == "fsdp1_full" and abs(ratio - 1.1 / 1.2) < 1e-12  # the faster of the two stage-3 peers
    assert rows["ddp"]["vs_peer"] is None
    assert rows["zerodp3"]["loss_diff"] == 0.0
    assert "| zerodp3 | 1.100 | 1.10 | 0.92 (fsdp1_full) |" in runner.table(rows)


def test_odd_rounds_run_the_strategies_in_reverse(monkeypatch, tmp_path):
    order = []

    def run_worker(name, model, steps, world, out):
        order.append(name)
        return fake_run(name, 1.0)

    monkeypatch.setattr(runner, "run_worker", run_worker)
    monkeypatch.setattr(runner, "chart", lambda rows, path, title: None)
    args = argparse.Namespace(strategies=["ddp", "zerodp1", "zerodp3"], stages=[], model="tiny", world_size=2,
                              rounds=3, steps=4, out=str(tmp_path / "out"), results=str(tmp_path / "RESULTS.md"))
    runner.compare(args)
    assert order == ["ddp", "zerodp1", "zerodp3", "zerodp3", "zerodp1", "ddp", "ddp", "zerodp1", "zerodp3"]
    assert "| zerodp3 |" in (tmp_path / "RESULTS.md").read_text()


def test_interleaved_rows_use_per_step_ratios_and_the_slower_rank():
    # step 2 ran while the machine was twice as slow: its ratio is still 1.2
    def rank(ddp_times, z3_times):
        return {"step_times": {"ddp": ddp_times, "zerodp3": z3_times},
                "cpu_times": {"ddp": [1.0] * 6, "zerodp3": [1.5] * 6},
                "losses": {"ddp": [3.0, 2.0], "zerodp3": [3.0, 2.0]}}
    ranks = [rank([9, 9, 2.0, 1.0, 1.0, 1.0], [9, 9, 2.4, 1.2, 1.2, 1.2]),
             rank([9, 9, 1.9, 0.9, 0.9, 0.9], [9, 9, 2.0, 1.0, 1.0, 1.0])]  # rank 0 is the slower one
    rows = runner.interleaved_rows(ranks)
    assert abs(rows["zerodp3"]["x_ddp"] - 1.2) < 1e-12
    assert rows["zerodp3"]["step_s"] == 1.2 and rows["zerodp3"]["cpu_s"] == 1.5
    assert rows["zerodp3"]["loss_diff"] == 0.0
