"""`lightning-islands report`, the recipes (Hydra experiments) and the quality benchmark's arithmetic."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import load_benchmark
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import lightning_islands.app.report as report
from lightning_islands.app.cli import main as cli_main
from lightning_islands.app.train import config_dir

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
SWEEPS = ["sweep_h", "sweep_outer", "sweep_codec", "sweep_imbalance", "sweep_sync_schedule", "sweep_budget_1000x",
          "sweep_expert_weighting", "sweep_outer_warmup", "sweep_ef_decay", "sweep_outer_1000x"]


def recipe_names() -> list[str]:
    return sorted(p.stem for p in (RECIPES / "experiment").glob("*.yaml"))


def _compose(overrides, hydra=False):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=hydra)


def _finished_run(run: Path, overrides: list[str]) -> tuple[Any, report.RunRecord]:
    """Compose ``overrides`` into ``run/job.yaml`` next to a minimal ``summary.json``, as a finished
    islands run leaves them, and read the folder back as the report does."""
    cfg = _compose(overrides)
    run.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run / "job.yaml")
    (run / "summary.json").write_text('{"strategy": "islands", "val_loss": 1.5}')
    return cfg, report.load_run(run / "summary.json")


# ------------------------------------------------------------------------------------------ recipes


def test_the_promised_recipes_exist():
    assert set(SWEEPS + ["quality_quick"]) <= set(recipe_names())


@pytest.mark.parametrize("name", recipe_names())
def test_recipe_composes_and_says_what_it_asks(name):
    lines = (RECIPES / "experiment" / f"{name}.yaml").read_text().splitlines()
    # Hydra reads the package header only before the first other line, so it must come first.
    assert lines[0] == "# @package _global_"
    assert lines[1].startswith("# Question:")
    cfg = _compose([f"experiment={name}"], hydra=True)
    assert cfg.experiment.name == name
    assert cfg.hydra.sweep.dir.startswith(f"runs/{name}/")
    params = cfg.hydra.sweeper.params
    if name.startswith("sweep_"):
        assert params, f"{name} sets no hydra.sweeper.params"
        # every value of every swept key composes on its own (group options exist, keys are valid)
        for key, values in params.items():
            for value in str(values).split(","):
                job = _compose([f"experiment={name}", f"{key}={value}"])
                OmegaConf.resolve(job)
    else:
        assert not params


def test_recipe_choices_reach_the_job():
    cfg = _compose(["experiment=sweep_codec", "codec_variant=int2_no_ef"])
    assert cfg.islands.codec == "int2" and cfg.islands.error_feedback is False
    cfg = _compose(["experiment=sweep_imbalance", "imbalance=island1_tiny"])
    sizes = [(m.devices, m.batch_size) for m in cfg.islands.members]
    assert sizes == [(2, 14), (1, 4)]
    for choice in ("even", "island0_small", "island1_small", "island1_tiny"):
        members = _compose(["experiment=sweep_imbalance", f"imbalance={choice}"]).islands.members
        assert sum(m.devices * m.batch_size for m in members) == 32  # same tokens per step in every job


def test_sync_schedules_spend_the_same_rounds_in_the_default_job():
    def round_lengths(cfg) -> list[int]:
        warmup, out = list(cfg.islands.sync_warmup or []), []
        while sum(out) < cfg.trainer.max_steps:
            out.append(warmup[len(out)] if len(out) < len(warmup) else cfg.islands.sync_every)
        return out

    schedules = {c: round_lengths(_compose(["experiment=sweep_sync_schedule", f"sync_schedule={c}"]))
                 for c in ("uniform", "warmup", "reverse")}
    assert schedules == {"uniform": [50] * 6, "warmup": [10, 20, 40, 80, 75, 75],
                         "reverse": [75, 75, 80, 40, 20, 10]}


def test_every_budget_choice_sends_about_a_thousandth_of_synchronous_dp():
    """Each choice of sweep_budget_1000x, on the model it trains: (steps x 2 sides x 4 N bytes of
    synchronous DP) / (rounds x 2 payloads) within 1/1200 .. 1/900, with the payload measured."""
    import torch
    from hydra.utils import instantiate

    from lightning_islands.codecs import make_codec

    choices = [p.stem for p in (RECIPES / "budget_1000x").glob("*.yaml")]
    assert len(choices) == 6
    n = sum(p.numel() for p in instantiate(_compose(["experiment=sweep_budget_1000x"]).model).parameters())
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    for choice in choices:
        cfg = _compose(["experiment=sweep_budget_1000x", f"budget_1000x={choice}"])
        assert cfg.trainer.max_steps == 1800 and cfg.islands.outer_momentum == 0.5
        payload = make_codec(cfg.islands.codec).encode(x).numel()
        ratio = (2 * 4 * n * cfg.islands.sync_every) / (2 * payload)
        assert 900 <= ratio <= 1200, (choice, ratio)


def test_sync_warmup_reaches_the_job_and_the_report_label(tmp_path):
    cfg, record = _finished_run(tmp_path, ["islands.sync_warmup=[10,20]"])
    assert list(cfg.islands.sync_warmup) == [10, 20] and _compose([]).islands.sync_warmup is None
    assert record.sync_warmup == [10, 20]
    assert f"H=10,20->{cfg.islands.sync_every} " in record.label


def test_expert_weighting_and_data_split_reach_the_report_label(tmp_path):
    """The four jobs of sweep_expert_weighting get four labels, so the report keeps them apart."""
    labels = set()
    for layout in ("interleaved", "contiguous"):
        for expert in ("false", "true"):
            _, record = _finished_run(tmp_path / f"{layout}_{expert}", [
                "experiment=sweep_expert_weighting", f"data.shard_layout={layout}",
                f"islands.expert_weighting={expert}"])
            assert record.expert_weighting is (expert == "true") and record.shard_layout == layout
            assert ("expert-weighted" in record.label) is (expert == "true")
            assert ("contiguous" in record.label) is (layout == "contiguous")
            labels.add(record.label)
    assert len(labels) == 4


def test_outer_warmup_reaches_the_job_and_the_report_label(tmp_path):
    """The four jobs of sweep_outer_warmup get four labels; only a warm-up that is on is named."""
    labels = set()
    for lr_w in (0, 10):
        for m_w in (0, 10):
            _, record = _finished_run(tmp_path / f"{lr_w}_{m_w}", [
                "experiment=sweep_outer_warmup", f"islands.outer_lr_warmup={lr_w}",
                f"islands.outer_momentum_warmup={m_w}"])
            assert (record.outer_lr_warmup, record.outer_momentum_warmup) == (lr_w, m_w)
            assert ("lr=0.7 (warm-up 10)" in record.label) is (lr_w == 10)
            assert ("m=0.5 (warm-up 10)" in record.label) is (m_w == 10)
            labels.add(record.label)
    assert len(labels) == 4
    assert _compose([]).islands.outer_lr_warmup == 0 and _compose([]).islands.outer_momentum_warmup == 0


def test_error_feedback_decay_reaches_the_report_label(tmp_path):
    _, plain = _finished_run(tmp_path / "plain", ["experiment=sweep_ef_decay", "islands.error_feedback_decay=1.0"])
    _, decayed = _finished_run(tmp_path / "decayed", ["experiment=sweep_ef_decay", "islands.error_feedback_decay=0.9"])
    assert plain.error_feedback_decay == 1.0 and "EF-decay" not in plain.label
    assert decayed.error_feedback_decay == 0.9 and "EF-decay 0.9" in decayed.label


def test_recipes_readme_lists_every_recipe():
    readme = (RECIPES / "README.md").read_text()
    for name in recipe_names():
        assert f"experiment={name}" in readme
    assert "lightning-islands report" in readme


# ------------------------------------------------------------------------------- runs and report


@pytest.fixture(scope="module")
def runs(finished_runs):
    """A tiny sweep_h sweep (2 jobs of two one-process islands, H=2 and H=4) and one `single` run, all
    finished, in one folder (see conftest.finished_runs, which tests/test_app.py reads too)."""
    return finished_runs


@pytest.mark.slow
def test_sweep_recipe_runs_end_to_end(runs):
    summaries = sorted((runs / "sweep_h").glob("multirun_*/*/summary.json"))
    assert len(summaries) == 2
    records = [report.load_run(p) for p in summaries]
    assert sorted(r.sync_every for r in records) == [2, 4]
    assert sorted(r.rounds for r in records) == [1, 2]  # 4 steps / H
    assert all(r.experiment == "sweep_h" and r.bytes_exchanged > 0 for r in records)


@pytest.mark.slow
def test_report_builds_its_table_from_finished_runs(runs, tmp_path, capsys):
    out = tmp_path / "rep"
    assert cli_main(["report", str(runs), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    table = (out / "report.md").read_text()
    body = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(body) == 3 and all(row in printed for row in body)
    single = next(row for row in body if "single 1x8" in row)
    assert "| 1.000 |" in single  # the centralized run is the baseline
    islands = [row for row in body if "islands 1x16+1x16" in row]
    assert {("H=2" in r, "H=4" in r) for r in islands} == {(True, False), (False, True)}
    assert all(" MB |" in r for r in islands)
    with (out / "report.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["strategy"] for r in rows) == ["islands", "islands", "single"]
    assert {r["sync_every"] for r in rows if r["strategy"] == "islands"} == {"2", "4"}
    assert all(float(r["tokens"]) > 0 and r["ratio"] for r in rows)
    # matplotlib is a dependency: a plain install draws both plots
    assert (out / "val_loss_vs_tokens.png").stat().st_size > 0
    assert (out / "loss_vs_bytes.png").stat().st_size > 0
    assert "val_loss_vs_tokens.png" in printed


@pytest.mark.slow
def test_validation_curve_counts_steps_done(runs):
    rec = next(report.load_run(p) for p in runs.rglob("summary.json") if "sweep_h" not in str(p))
    points = report.val_curve(rec)
    # validated after 2 and 4 steps (Lightning logs the in-fit ones at step 1 and 3), 8 windows x 64 per step
    assert [t for t, _ in points] == [2 * 8 * 64, 4 * 8 * 64]
    assert points[-1][1] == pytest.approx(rec.val_loss)


def test_report_of_a_folder_without_runs_names_it(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no summary.json" in err and str(tmp_path) in err


# ------------------------------------------------------------------------------ quality benchmark


def _bench():
    return load_benchmark("quality")


def test_quality_benchmark_compares_at_equal_tokens_per_step():
    bench = _bench()
    jobs = {j.name: j for j in bench.plan("quick", 300, [25, 50], ["fp32", "int4"], ["seed=7"])}
    assert set(jobs) == {"centralized", "alone_island0", "alone_island1", "islands_H25_fp32", "islands_H25_int4",
                         "islands_H50_fp32", "islands_H50_int4"}

    def windows(name):
        cfg = _compose([o for o in jobs[name].overrides if not o.startswith("hydra.")])
        if cfg.strategy.name == "islands":
            return sum(m.devices * m.batch_size for m in cfg.islands.members), cfg.trainer.max_steps
        return cfg.strategy.get("devices", 1) * cfg.data.batch_size, cfg.trainer.max_steps

    assert windows("centralized") == windows("islands_H50_int4") == (32, 300)
    assert windows("alone_island0") == windows("alone_island1") == (16, 300)
    assert all("seed=7" in j.overrides for j in jobs.values())
    large = {j.name: j for j in bench.plan("large", 1200, [50], ["fp32"], [])}
    assert "data.batch_size=32" in large["centralized"].overrides


def test_quality_benchmark_gpu_setting_fits_one_gpu_at_equal_tokens_per_step():
    bench = _bench()
    jobs = {j.name: j for j in bench.plan("gpu", 1800, [24], ["topk:0.1+int2"], [])}
    assert set(jobs) == {"centralized", "alone_island", "islands_H24_topk:0.1+int2"}
    cfgs = {name: _compose([o for o in job.overrides if not o.startswith("hydra.")]) for name, job in jobs.items()}
    for cfg in cfgs.values():
        assert cfg.trainer.accelerator == "gpu" and cfg.trainer.max_steps == 1800
        assert cfg.model.d_model == 384 and cfg.data.seq_len == 256
    islands = cfgs["islands_H24_topk:0.1+int2"].islands.members
    assert [(m.devices, m.batch_size) for m in islands] == [(1, 16), (1, 16)]  # one NCCL rank per GPU process
    assert cfgs["centralized"].strategy.name == "single" and cfgs["centralized"].data.batch_size == 32
    assert cfgs["alone_island"].strategy.name == "single" and cfgs["alone_island"].data.batch_size == 16


def test_quality_benchmark_scores():
    bench = _bench()
    jobs = bench.plan("quick", 100, [25], ["fp32"], [])
    losses = {"centralized": 2.0, "alone_island0": 2.5, "alone_island1": 2.4, "islands_H25_fp32": 2.1}
    n = 1000
    for job in jobs:
        job.record = report.RunRecord(name=job.name, run_dir=".", experiment="q", label=job.name,
                                      strategy="islands" if job.kind == "islands" else "fsdp",
                                      val_loss=losses[job.name], parameters=n,
                                      bytes_exchanged=8e4 if job.kind == "islands" else 0.0)
    assert bench.score(jobs, 100) == {None: (2.0, 2.4)}
    m = next(j for j in jobs if j.kind == "islands").metrics
    assert m["gain_recovered"] == pytest.approx(0.75)
    assert m["vs_centralized"] == pytest.approx(1.05)
    assert m["vs_sync_dp"] == pytest.approx(8e4 / (100 * 2 * 4 * n))


def test_quality_benchmark_compares_each_seed_with_its_own_baselines():
    bench = _bench()
    jobs = bench.plan("quick", 100, [10], ["int4"], ["model=dense_cpu"], seeds=[1, 2])
    assert [j.name for j in jobs] == [f"{c}_s{s}" for s in (1, 2) for c in
                                      ("islands_H10_int4", "centralized", "alone_island0", "alone_island1")]
    assert all(f"seed={j.seed}" in j.overrides and "model=dense_cpu" in j.overrides for j in jobs)
    assert all(o.endswith(j.name) for j in jobs for o in j.overrides if o.startswith("hydra.run.dir="))
    losses = {1: {"centralized": 2.0, "alone_island0": 2.5, "alone_island1": 2.4, "islands_H10_int4": 2.1},
              2: {"centralized": 2.2, "alone_island0": 2.6, "alone_island1": 2.7, "islands_H10_int4": 2.2}}
    for job in jobs:
        job.record = report.RunRecord(name=job.name, run_dir=".", experiment="q", label=job.name,
                                      strategy="islands" if job.kind == "islands" else "fsdp",
                                      val_loss=losses[job.seed][job.config], parameters=1000, bytes_exchanged=0.0)
    assert bench.score(jobs, 100) == {1: (2.0, 2.4), 2: (2.2, 2.6)}
    islands = {j.seed: j.metrics for j in jobs if j.kind == "islands"}
    assert islands[1]["vs_centralized"] == pytest.approx(1.05) and islands[2]["vs_centralized"] == pytest.approx(1.0)
    assert islands[1]["gain_recovered"] == pytest.approx(0.75) and islands[2]["gain_recovered"] == pytest.approx(1.0)
    md, rows = bench.seed_summary(jobs)
    row = next(r for r in rows if r["config"] == "islands_H10_int4")
    assert row["seeds"] == [1, 2]
    assert row["vs_centralized_mean"] == pytest.approx(1.025)
    assert (row["val_loss_min"], row["val_loss_max"]) == (2.1, 2.2)
    assert "islands_H10_int4 | 2 | 2.1500 (2.1000 – 2.2000) | 1.025 (1.000 – 1.050)" in md


def test_a_multiruns_jobs_are_found_in_job_order(tmp_path):
    for job in ("10", "2", "1"):
        (tmp_path / "multirun_2026-12-01_04-46-25" / job).mkdir(parents=True)
        (tmp_path / "multirun_2026-12-01_04-46-25" / job / "summary.json").write_text("{}")
    found = [p.parent.name for p in report.find_summaries(tmp_path)]
    assert found == ["1", "2", "10"]


def test_the_summary_counts_bytes_against_fp32_and_synchronous_data_parallelism(tmp_path):
    from lightning_islands.app.summary import format_summary, summarize

    n = 1_000_000
    for i, (world, steps) in enumerate([(2, 300), (1, 300)]):
        result = {"island": i, "num_islands": 2, "strategy": "islands", "world_size": world, "batch_size": 8,
                  "global_step": 316, "fit_steps": steps, "fit_seconds": 10.0, "val_loss": 1.6, "val_ppl": 5.0,
                  "tokens": 1000, "parameters": {"total": n, "active": n // 3}, "rounds": 12,
                  "islands": {"bytes_sent": 12 * 0.53 * n, "seconds_exchanging": 0.1, "seconds_waiting": 0.2}}
        (tmp_path / f"island{i}").mkdir()
        (tmp_path / f"island{i}" / "result.json").write_text(json.dumps(result))
    summary = summarize(tmp_path)
    assert summary["bytes_fp32"] == 12 * 2 * 4 * n  # 12 rounds, each island sends 4 bytes a parameter
    assert summary["bytes_sync_dp"] == 300 * 8 * n  # the steps of this fit, not the resumed checkpoint's
    text = format_summary({**summary, "plots": ["r/report/loss_vs_bytes.png"]})
    assert "7.5x fewer than the same rounds in fp32" in text
    assert "188.7x fewer than synchronous data parallelism" in text
    assert "plot                r/report/loss_vs_bytes.png" in text
