"""The scaling benchmark's plan (sizes, steps, settings) and its arithmetic (ratios, trend verdict)."""

from __future__ import annotations

import pytest
from conftest import load_benchmark
from hydra import compose, initialize_config_dir

import lightning_islands.app.report as report
from lightning_islands.app.train import config_dir


def _bench():
    return load_benchmark("scaling")


def _compose(overrides):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=[o for o in overrides if not o.startswith("hydra.")])


def _windows(cfg) -> int:
    if cfg.strategy.name == "islands":
        return sum(m.devices * m.batch_size for m in cfg.islands.members)
    return cfg.strategy.get("devices", 1) * cfg.data.batch_size


def test_every_size_trains_the_same_tokens_per_active_parameter_at_the_same_islands_settings():
    bench = _bench()
    ladder = bench.LADDERS["cpu"]
    sizes = bench.sizes_of(ladder, ["xs", "s", "m"], 1800)
    assert [s.name for s in sizes] == ["xs", "s", "m"]
    assert sizes[-1].steps == 1800 and sizes[-1].active == 1_086_592  # the provided MoE's CPU preset
    assert sizes[0].active < sizes[1].active < sizes[2].active
    per_param = [s.tokens / s.active for s in sizes]
    assert max(per_param) / min(per_param) < 1.01  # steps are rounded to whole steps
    jobs = bench.plan(ladder, sizes, [7], ["topk:0.1+int2"], bench.DEFAULT_ISLANDS, [])
    assert [j.name for j in jobs] == [f"{s}_{k}_s7" for s in ("xs", "s", "m")
                                      for k in ("centralized", "islands_topk:0.1+int2")]
    islands_settings = set()
    for job, size in zip(jobs, [s for s in sizes for _ in range(2)]):
        cfg = _compose(job.overrides)
        assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.d_ff) == (
            ladder.sizes[size.name]["d_model"], ladder.sizes[size.name]["n_layers"], ladder.sizes[size.name]["d_ff"])
        assert cfg.trainer.max_steps == size.steps and cfg.seed == 7
        assert _windows(cfg) == bench.WINDOWS_PER_STEP and cfg.data.seq_len == size.seq_len
        if job.kind == "islands":
            islands_settings.add((cfg.islands.codec, cfg.islands.sync_every, cfg.islands.outer_lr,
                                  cfg.islands.outer_momentum, cfg.islands.error_feedback_decay))
    assert islands_settings == {("topk:0.1+int2", 24, 0.7, 0.7, 0.8)}  # one schedule at every size


def test_the_gpu_ladder_runs_one_process_per_island_on_the_gpu():
    bench = _bench()
    ladder = bench.LADDERS["gpu"]
    sizes = bench.sizes_of(ladder, list(ladder.sizes), 600)
    assert sizes[1].steps == 600 and sizes[1].active == 10_738_560  # g2 is the preset moe_gpu_small
    for job in bench.plan(ladder, sizes, [1], ["int4"], ["islands.sync_every=24"], []):
        cfg = _compose(job.overrides)
        assert cfg.trainer.accelerator == "gpu" and _windows(cfg) == bench.WINDOWS_PER_STEP
        assert cfg.model.d_model // cfg.model.n_heads == 64
        if job.kind == "islands":
            assert [m.devices for m in cfg.islands.members] == [1, 1]
    with pytest.raises(SystemExit, match="unknown size.*g1, g2, g3"):
        bench.sizes_of(ladder, ["xl"], 600)


def _scored(bench, losses: dict[tuple[str, int, str], float], codecs: list[str]):
    ladder = bench.LADDERS["cpu"]
    sizes = bench.sizes_of(ladder, ["xs", "m"], 100)
    jobs = bench.plan(ladder, sizes, [1, 2], codecs, bench.DEFAULT_ISLANDS, [])
    for job in jobs:
        kind = "c" if job.kind == "centralized" else job.codec
        job.record = report.RunRecord(name=job.name, run_dir=".", experiment="q", label=job.name,
                                      strategy="islands" if job.kind == "islands" else "fsdp",
                                      val_loss=losses[(job.metrics["size"], job.seed, kind)],
                                      bytes_exchanged=1e4 if job.kind == "islands" else 0.0)
    return sizes, jobs


def test_each_islands_run_is_compared_with_the_centralized_run_of_its_size_and_seed():
    bench = _bench()
    losses = {("xs", 1, "c"): 2.0, ("xs", 1, "int4"): 2.02, ("xs", 2, "c"): 2.1, ("xs", 2, "int4"): 2.1,
              ("m", 1, "c"): 1.5, ("m", 1, "int4"): 1.485, ("m", 2, "c"): 1.6, ("m", 2, "int4"): 1.6}
    sizes, jobs = _scored(bench, losses, ["int4"])
    rows = bench.score(jobs)
    assert [(r["size"], r["seed"]) for r in rows] == [("xs", 1), ("m", 1), ("xs", 2), ("m", 2)]
    xs1 = rows[0]
    assert xs1["ratio"] == pytest.approx(1.01) and xs1["centralized_loss"] == 2.0
    assert xs1["sync_dp_bytes"] == sizes[0].steps * 8 * sizes[0].total
    assert xs1["bytes_ratio"] == pytest.approx(sizes[0].steps * 8 * sizes[0].total / 1e4)
    summary = bench.over_seeds(rows)
    assert [(s["size"], s["seeds"]) for s in summary] == [("xs", [1, 2]), ("m", [1, 2])]
    assert summary[0]["ratio_mean"] == pytest.approx(1.005)
    assert (summary[1]["ratio_min"], summary[1]["ratio_max"]) == (pytest.approx(0.99), 1.0)
    text = bench.verdict(summary, "int4")
    assert "at or below 1.00 at 1 of 2 sizes (m)" in text and "does not grow with size" in text
    assert "## Per size and codec" in bench.tables(rows, summary)


def test_a_ratio_that_rises_beyond_the_seeds_spread_is_called_growing():
    bench = _bench()
    losses = {("xs", 1, "c"): 2.0, ("xs", 1, "int4"): 1.98, ("xs", 2, "c"): 2.0, ("xs", 2, "int4"): 1.99,
              ("m", 1, "c"): 1.5, ("m", 1, "int4"): 1.53, ("m", 2, "c"): 1.5, ("m", 2, "int4"): 1.535}
    _, jobs = _scored(bench, losses, ["int4"])
    summary = bench.over_seeds(bench.score(jobs))
    assert "grows with size" in bench.verdict(summary, "int4")
    assert "fewer than two sizes" in bench.verdict(summary[:1], "int4")


def test_a_resume_refuses_a_finished_run_of_other_settings(tmp_path):
    from omegaconf import OmegaConf

    bench = _bench()
    ladder = bench.LADDERS["cpu"]
    job = bench.plan(ladder, bench.sizes_of(ladder, ["xs"], 1800), [3], ["int4"], bench.DEFAULT_ISLANDS, [])[1]
    cfg = _compose(job.overrides)
    OmegaConf.save(cfg, tmp_path / "job.yaml")
    assert bench._differs(job, tmp_path) == ""
    cfg.islands.sync_every = 48
    OmegaConf.save(cfg, tmp_path / "job.yaml")
    assert bench._differs(job, tmp_path) == "islands.sync_every=48"
