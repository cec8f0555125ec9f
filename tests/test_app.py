"""The Hydra app: composition of every option, real launches of the default job, FSDP2, sweeps."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_islands.app.train import config_dir, island_plan
from lightning_islands.app.worker import build_strategy, island_member

CONF = Path(config_dir())
GROUPS = ["model", "data", "strategy", "islands", "trainer", "logger", "experiment"]
SMALL = ["trainer.max_steps=12", "trainer.val_check_interval=6", "trainer.checkpoint_every_n_steps=6",
         "data.max_bytes=400000", "data.val_windows=16", "data.val_batch_size=8", "islands.sync_every=3"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    env = dict(os.environ)
    env["LIGHTNING_ISLANDS_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    env["WANDB_MODE"] = "offline"
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_of_every_group_composes(group):
    assert options(group), f"conf/{group} is empty"
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for option in options(group):
            overrides = [f"{group}={option}"]
            if group == "data" and option == "folder":
                overrides.append(f"data.source={CONF}")
            cfg = compose(config_name="config", overrides=overrides)
            OmegaConf.resolve(cfg)
            assert cfg[group] is not None
            if group == "model":
                with torch.device("meta"):
                    model = instantiate(cfg.model)
                assert model.num_parameters()["total"] > 0
            if group == "data":
                assert instantiate(cfg.data).batch_size > 0
            if group == "strategy":
                member = island_member(cfg, 0)
                assert island_plan(cfg)
                if option == "islands":
                    os.environ.pop("LI_COORDINATOR", None)
                    cfg.islands.members = [cfg.islands.members[0]]  # one island needs no coordinator
                    assert build_strategy(cfg, 0, member).num_islands == 1
                else:
                    assert build_strategy(cfg, 0, member) is not None


def _one_island_strategy(overrides: list[str]) -> tuple[Any, Any]:
    """The composed config and the strategy of its first island, alone (so no coordinator)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    os.environ.pop("LI_COORDINATOR", None)
    cfg.islands.members = [cfg.islands.members[0]]
    return cfg, build_strategy(cfg, 0, island_member(cfg, 0))


def test_outer_warmup_reaches_the_strategy():
    cfg, strategy = _one_island_strategy(["islands.outer_lr_warmup=10", "islands.outer_momentum_warmup=5"])
    opt = strategy.outer_opt
    assert (opt.lr_warmup, opt.momentum_warmup) == (10, 5)
    assert opt.lr_at(1) == pytest.approx(cfg.islands.outer_lr / 10)
    assert opt.momentum_at(1) == pytest.approx(cfg.islands.outer_momentum / 5)


def test_error_feedback_decay_reaches_the_strategy_and_bad_values_are_named():
    assert _one_island_strategy([])[1].error_feedback_decay == 1.0
    _, decayed = _one_island_strategy(["islands.codec=int4", "islands.error_feedback_decay=0.9"])
    assert decayed.error_feedback_decay == 0.9
    with pytest.raises(ValueError, match=r"error feedback is off \(the default for codec 'fp32'\).*"
                                         r"islands.error_feedback=true"):
        _one_island_strategy(["islands.codec=fp32", "islands.error_feedback_decay=0.9"])
    with pytest.raises(ValueError, match=r"error feedback is off \(error_feedback=False\)"):
        _one_island_strategy(["islands.codec=int4", "islands.error_feedback=false", "islands.error_feedback_decay=0.9"])
    with pytest.raises(ValueError, match=r"islands.error_feedback_decay\) must be in \[0, 1\].*got 1.5"):
        _one_island_strategy(["islands.codec=int4", "islands.error_feedback_decay=1.5"])


def test_default_config_is_two_heterogeneous_islands_with_the_moe():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config")
    assert cfg.strategy.name == "islands" and cfg.data.source == "stdlib"
    assert cfg.model._target_.endswith("MoELanguageModel") and cfg.model.n_experts > 0
    members = cfg.islands.members
    assert len(members) == 2 and members[0].devices != members[1].devices
    assert members[0].batch_size != members[1].batch_size


def _train(args, cwd, env, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "lightning_islands.app.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def _run_dir(stdout: str) -> Path:
    return Path(stdout.split("run folder ", 1)[1].split()[0])


@pytest.mark.slow
def test_main_job_runs_and_prints_its_summary(tmp_path, cache_env):
    out = _train(SMALL, tmp_path, cache_env)
    assert "=== lightning-islands summary ===" in out
    run = _run_dir(out)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["strategy"] == "islands" and summary["rounds"] == 4
    losses = summary["val_loss_per_island"]
    # same global model on every island; only the split of the validation set over ranks differs
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert summary["bytes_exchanged"] > 0
    assert (run / "island0" / "checkpoints" / "last.ckpt").is_dir()
    assert (run / "logs" / "island1" / "metrics.csv").is_file()


def _losses(metrics_csv: Path) -> list[float]:
    with metrics_csv.open() as f:
        return [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]


@pytest.mark.slow
def test_fsdp2_two_processes_loss_falls_and_checkpoint_resumes(tmp_path, cache_env):
    args = ["strategy=fsdp", "trainer.max_steps=30", "trainer.val_check_interval=15",
            "trainer.checkpoint_every_n_steps=15", "trainer.log_every_n_steps=1", "data.max_bytes=400000",
            "data.val_windows=16", "data.val_batch_size=8"]
    out = _train(args, tmp_path, cache_env)
    run = _run_dir(out)
    losses = _losses(run / "logs" / "island0" / "metrics.csv")
    assert len(losses) >= 20 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    ckpt = run / "island0" / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir()
    longer = [a for a in args if not a.startswith("trainer.max_steps")] + ["trainer.max_steps=40"]
    out2 = _train([*longer, f"resume={ckpt}"], tmp_path, cache_env)
    result = json.loads((_run_dir(out2) / "island0" / "result.json").read_text())
    assert result["global_step"] == 40
    resumed = _losses(_run_dir(out2) / "logs" / "island0" / "metrics.csv")
    assert len(resumed) == 10, "the resumed run trains only the 10 remaining steps"

    # the same plain FSDP checkpoint seeds a two-island run (2 ranks and 1 rank: resharded on load)
    fsdp_val = json.loads((run / "summary.json").read_text())["val_loss"]
    out3 = _train(["trainer.max_steps=36", "trainer.val_check_interval=6", "trainer.checkpoint_every_n_steps=6",
                   "data.max_bytes=400000", "data.val_windows=16", "data.val_batch_size=8", "islands.sync_every=3",
                   f"resume={ckpt}"], tmp_path, cache_env)
    seeded = json.loads((_run_dir(out3) / "summary.json").read_text())
    assert seeded["strategy"] == "islands" and seeded["rounds"] == 2
    for island in (0, 1):
        result = json.loads((_run_dir(out3) / f"island{island}" / "result.json").read_text())
        assert result["global_step"] == 36
    # 6 steps from random weights land far above (~4.5); from the checkpoint they continue its curve
    assert seeded["val_loss_per_island"][0] < fsdp_val + 0.15, (seeded["val_loss_per_island"], fsdp_val)


@pytest.mark.slow
def test_multirun_sweep_of_two_jobs(tmp_path, cache_env):
    out = _train(["-m", "islands.sync_every=2,3", "islands=two_equal", *SMALL[:-1]], tmp_path, cache_env)
    summaries = sorted(tmp_path.glob("runs/default/multirun_*/*/summary.json"))
    assert len(summaries) == 2, out[-2000:]
    rounds = sorted(json.loads(p.read_text())["rounds"] for p in summaries)
    assert rounds == [4, 6]


@pytest.mark.slow
def test_moe_expert_weighting_with_time_balanced_slow_island(tmp_path, cache_env):
    args = ["islands=slow_island", "islands.expert_weighting=true", "islands.balance=time", "islands.max_rounds=3",
            # 1 s per step on top of the slow island's compute: the fast island stays >1.25x faster (what it
            # needs to be given more steps) even on a loaded machine, where 0.3 s once was not enough
            "islands.sync_every=2", "islands.members.1.step_delay_s=1.0", "trainer.max_steps=1000",
            "trainer.val_check_interval=1000", "trainer.checkpoint_every_n_steps=0", "data.max_bytes=400000",
            "data.val_windows=8", "data.val_batch_size=8"]
    run = _run_dir(_train(args, tmp_path, cache_env))
    summary = json.loads((run / "summary.json").read_text())
    fast, slow = summary["islands"]
    assert summary["rounds"] == 3
    assert fast["global_step"] > slow["global_step"], "the fast island runs more inner steps"
    assert fast["val_loss"] == pytest.approx(slow["val_loss"], rel=1e-5)
    assert 0.0 <= fast["idle_fraction"] < 1.0
    with (run / "logs" / "island0" / "metrics.csv").open() as f:
        gaps = [(float(r["islands/expert_share_gap_max"]), float(r["islands/expert_share_gap_mean"]))
                for r in csv.DictReader(f) if r.get("islands/expert_share_gap_max")]
    assert len(gaps) == 3, "every round logs how far expert weighting moved the merge"
    # the islands' token shares differ (the fast island runs more steps), so the experts' shares do too
    assert all(0.0 <= mean <= largest <= 1.0 for largest, mean in gaps) and max(g[0] for g in gaps) > 0.0


@pytest.mark.slow
@pytest.mark.parametrize("strategy, logger", [("ddp", "wandb"), ("single", "tensorboard")])
def test_other_strategies_and_loggers_run(tmp_path, cache_env, strategy, logger):
    args = [f"strategy={strategy}", f"logger={logger}", "trainer.max_steps=4", "trainer.val_check_interval=2",
            "trainer.checkpoint_every_n_steps=0", "data.max_bytes=300000", "data.val_windows=8",
            "data.val_batch_size=4", "experiment.name=smoke"]
    run = _run_dir(_train(args, tmp_path, cache_env))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["strategy"] == strategy and summary["islands"][0]["global_step"] == 4
    if logger == "wandb":
        offline_runs = list((run / "wandb").glob("offline-run-*"))
        assert len(offline_runs) == 1, "one offline W&B run for the island"
    else:
        assert list((run / "tb" / "island0").glob("events.out.tfevents.*"))
