"""A run's own history (island*/history.jsonl) and what the report draws from it, whatever the logger."""

from __future__ import annotations

import json

import pytest

from lightning_islands.app.history import read_history, run_histories
from lightning_islands.app.round_plots import plot_rounds, round_rows, val_points


def _write(path, records, torn=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    path.write_text(text + ('{"event": "val", "st' if torn else ""))


def _two_islands(tmp_path):
    _write(tmp_path / "island0" / "history.jsonl", [
        {"event": "start", "t": 0.0},
        {"event": "round", "round": 1, "t": 2.0, "tokens": 100, "bytes_sent": 10, "seconds_exchanging": 0.5,
         "seconds_waiting": 0.25, "islands_present": 2},
        {"event": "val", "round": 1, "t": 2.5, "tokens": 100, "val_loss": 3.0},
        {"event": "round", "round": 2, "t": 5.0, "tokens": 200, "bytes_sent": 10, "seconds_blocking": 1.0,
         "seconds_waiting": 0.5, "islands_present": 1},
        {"event": "val", "round": 2, "t": 6.0, "tokens": 230, "val_loss": 2.5, "step": 7},
        {"event": "val", "round": 2, "t": 6.0, "tokens": 230, "val_loss": 2.0, "step": 7}], torn=True)
    _write(tmp_path / "island1" / "history.jsonl", [
        {"event": "round", "round": 1, "t": 2.0, "tokens": 50}, {"event": "round", "round": 2, "t": 4.0, "tokens": 90}])


def test_island_zero_s_curve_counts_every_island_s_tokens_by_the_same_round(tmp_path):
    _two_islands(tmp_path)
    histories = run_histories(tmp_path)
    assert sorted(histories) == [0, 1] and len(read_history(tmp_path / "island0" / "history.jsonl")) == 6
    assert val_points(histories) == [(150.0, 2.5, 3.0), (320.0, 6.0, 2.0)]
    assert val_points({}) == []


def test_each_round_s_time_splits_into_compute_exchange_and_wait(tmp_path):
    _two_islands(tmp_path)
    first, flown = round_rows(run_histories(tmp_path)[0])
    assert (first["compute"], first["exchange"], first["wait"]) == (1.25, 0.5, 0.25)
    # a flown round: the training thread's blocking share, its wait apart
    assert (flown["compute"], flown["exchange"], flown["wait"]) == (2.0, 0.5, 0.5)
    assert (first["present"], flown["present"]) == (2.0, 1.0)
    assert plot_rounds(run_histories(tmp_path), tmp_path / "rounds.png", "two islands")
    assert (tmp_path / "rounds.png").stat().st_size > 0
    assert not plot_rounds({0: [{"event": "start", "t": 0.0}]}, tmp_path / "none.png", "no rounds")


def test_a_restarted_island_continues_its_clock_and_its_rounds_count_from_the_restart(tmp_path):
    from types import SimpleNamespace

    from lightning_islands.app.history import History

    path = tmp_path / "island1" / "history.jsonl"
    _write(path, [{"event": "start", "t": 0.0, "wall": 1000.0},
                  {"event": "round", "round": 1, "t": 10.0, "tokens": 5, "wall": 1010.0}])
    restarted = History(path, island=1, tokens_per_step=1.0)
    trainer = SimpleNamespace(global_rank=0, global_step=0, strategy=SimpleNamespace())
    restarted.on_fit_start(trainer, None)  # the restarted process: its clock goes on from the file's start
    start = read_history(path)[-1]
    assert start["event"] == "start" and start["t"] == pytest.approx(start["wall"] - 1000.0)
    records = [*read_history(path), {"event": "round", "round": 2, "t": start["t"] + 4.0, "tokens": 9}]
    assert round_rows(records)[-1]["compute"] == pytest.approx(4.0), "measured from the restart, not round 1"


def test_a_multirun_job_s_launch_name_carries_its_sweep():
    from pathlib import Path

    from lightning_islands.app.components import launch_name

    assert launch_name(Path("runs/exp/multirun_2026-12-06_07-00-00/3")) == "multirun_2026-12-06_07-00-00-3"
    assert launch_name(Path("runs/exp/2026-12-06_07-00-00")) == "2026-12-06_07-00-00"


@pytest.mark.parametrize("points", [5])
def test_plan_draws_utilization_against_link_bandwidth(tmp_path, points):
    from lightning_islands.app.plan import plot_utilization, utilization_curve
    from lightning_islands.plan.inputs import IslandSpec, LinkSpec, PlanInputs
    from lightning_islands.plan.search import min_link_bps

    inputs = PlanInputs((IslandSpec(1, 0.5, 1e12, 1e12), IslandSpec(2, 0.5, 1e12, 1e12)), numel=10_000_000,
                        link=LinkSpec(bps=1e8, rtt_s=0.05), sync_every=10, codec="fp32")
    curve = utilization_curve(inputs, points=points)
    assert [bps for bps, _ in curve][0] == pytest.approx(1e6) and curve[-1][0] == pytest.approx(1e10)
    slowest = [min(u) for _, u in curve]
    assert slowest == sorted(slowest) and slowest[0] < 0.5 < slowest[-1], "a faster link never hurts"
    plot_utilization(inputs, min_link_bps(inputs, 0.9), str(tmp_path / "u.png"))
    assert (tmp_path / "u.png").stat().st_size > 0
