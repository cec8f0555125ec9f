"""The Hydra app: composition of every option, real launches of the default job, FSDP2, sweeps."""

from __future__ import annotations

import csv
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import NO_CHECKPOINTS, TINY_DATA, TINY_MODEL, run_dir_of, train, train_together
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_islands.app.components import build_loggers
from lightning_islands.app.train import config_dir, island_plan
from lightning_islands.app.worker import build_strategy, island_member

CONF = Path(config_dir())
GROUPS = ["model", "data", "strategy", "islands", "trainer", "logger", "experiment"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


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
    opt = strategy.settings.outer_optimizer()
    assert (opt.lr_warmup, opt.momentum_warmup) == (10, 5)
    assert opt.lr_at(1) == pytest.approx(cfg.islands.outer_lr / 10)
    assert opt.momentum_at(1) == pytest.approx(cfg.islands.outer_momentum / 5)


def test_error_feedback_decay_reaches_the_strategy_and_bad_values_are_named():
    assert _one_island_strategy([])[1].settings.error_feedback_decay == 1.0
    _, decayed = _one_island_strategy(["islands.codec=int4", "islands.error_feedback_decay=0.9"])
    assert decayed.settings.error_feedback_decay == 0.9
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
    # the default exchange is quantized, with error feedback
    _, strategy = _one_island_strategy([])
    assert cfg.islands.codec == "int4" and strategy.settings.use_error_feedback


def _losses(metrics_csv: Path) -> list[float]:
    with metrics_csv.open() as f:
        return [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _fsdp_then_islands(cwds: dict[str, Path], app_env: dict) -> dict[str, tuple[str, Path]]:
    """FSDP2 over two processes from scratch (16 steps, a checkpoint every 8), then at the same time:
    the same job resumed from its last checkpoint to 20 steps, and the default job (two heterogeneous
    islands of 2 and 1 processes) seeded with that plain FSDP checkpoint, 6 more steps in two rounds
    of H=3, resharded from 2 ranks to 2 and 1 on load. Returns their outputs and run folders."""
    fsdp = ["strategy=fsdp", *TINY_MODEL, *TINY_DATA, "trainer.val_check_interval=8",
            "trainer.checkpoint_every_n_steps=8", "trainer.log_every_n_steps=1"]
    out = train([*fsdp, "trainer.max_steps=16"], cwds["fsdp"], app_env)
    ckpt = run_dir_of(out) / "island0" / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir(), out[-3000:]
    # a callback and a Trainer keyword from the command line; the callback (tests/scripts) records
    # the islands/* metrics it saw in trainer.callback_metrics
    seen = "+callbacks.seen={_target_:round_metrics.RoundMetricsSeen,path:'${li:run_dir}/seen${li:island}.json'}"
    scripts = str(Path(__file__).parent / "scripts")
    env = {**app_env, "PYTHONPATH": os.pathsep.join(p for p in (scripts, app_env.get("PYTHONPATH")) if p)}
    outs = train_together({  # each in a folder of its own: runs started in the same second share a name
        "resumed": ([*fsdp, "trainer.max_steps=20", f"resume={ckpt}"], cwds["resumed"]),
        "islands": ([*TINY_MODEL, *TINY_DATA, "trainer.max_steps=22", "trainer.val_check_interval=6",
                     "trainer.checkpoint_every_n_steps=6", "islands.sync_every=3", f"resume={ckpt}", seen,
                     "+trainer.num_sanity_val_steps=0", "logger=wandb"], cwds["islands"]),
    }, env)
    return {name: (text, run_dir_of(text)) for name, text in {"fsdp": out, **outs}.items()}


def _moe_and_ddp(cwds: dict[str, Path], app_env: dict) -> dict[str, Path]:
    """Two launches at once: the MoE with expert weighting on two islands, one slowed down and
    balanced by time (3 rounds of H=2 on the slow island), and DDP over two processes logging to W&B
    (offline). Returns their run folders."""
    moe = ["islands=slow_island", "islands.expert_weighting=true", "islands.balance=time", "islands.max_rounds=3",
           # 0.5 s per step on top of the slow island's compute (tens of ms for this model): the fast island
           # stays far more than 1.25x faster (what it needs to be given more steps) even on a loaded machine
           "islands.sync_every=2", "islands.members.1.step_delay_s=0.5", "trainer.max_steps=1000",
           "trainer.val_check_interval=1000", *NO_CHECKPOINTS, *TINY_MODEL, *TINY_DATA]
    ddp = ["strategy=ddp", "logger=wandb", "trainer.max_steps=4", "trainer.val_check_interval=2",
           *NO_CHECKPOINTS, *TINY_MODEL, *TINY_DATA, "experiment.name=smoke"]
    outs = train_together({"moe": (moe, cwds["moe"]), "ddp": (ddp, cwds["ddp"])}, app_env)
    return {name: run_dir_of(text) for name, text in outs.items()}


@pytest.fixture(scope="module")
def app_runs(request, tmp_path_factory, app_env):
    """Every launch this module's slow tests read, as concurrently as their order allows: the FSDP
    chain (:func:`_fsdp_then_islands`) and, after it starts, the MoE and DDP pair (:func:`_moe_and_ddp`)
    each in a thread of its own, while this thread makes the session's ``finished_runs`` (a sweep and
    a single run). On 2 cores much of a launch is waiting (for the other processes of its world, for
    the launcher's polls): together they take far less than one after the other."""
    cwds = {name: tmp_path_factory.mktemp(name) for name in ("fsdp", "resumed", "islands", "moe", "ddp")}
    made: dict[str, Any] = {}

    def run(name, job):
        try:
            made[name] = job(cwds, app_env)
        except BaseException as err:  # noqa: BLE001 - raised below, in the test's thread
            made[name] = err

    threads = [threading.Thread(target=run, args=(name, job))
               for name, job in (("fsdp", _fsdp_then_islands), ("moe", _moe_and_ddp))]
    for t in threads:
        t.start()
    try:
        request.getfixturevalue("finished_runs")  # pytest's own work stays in this thread
    finally:
        for t in threads:
            t.join()
    for outcome in made.values():
        if isinstance(outcome, BaseException):
            raise outcome
    return made


@pytest.fixture(scope="module")
def fsdp_then_islands(app_runs):
    """See :func:`_fsdp_then_islands`."""
    return app_runs["fsdp"]


@pytest.fixture(scope="module")
def moe_and_ddp(app_runs):
    """See :func:`_moe_and_ddp`."""
    return app_runs["moe"]


@pytest.mark.slow
def test_fsdp2_two_processes_loss_falls(fsdp_then_islands):
    _, run = fsdp_then_islands["fsdp"]
    assert _json(run / "island0" / "result.json")["world_size"] == 2
    losses = _losses(run / "logs" / "island0" / "metrics.csv")
    assert len(losses) == 16 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses


@pytest.mark.slow
def test_fsdp2_checkpoint_resumes(fsdp_then_islands):
    _, run = fsdp_then_islands["resumed"]
    assert _json(run / "island0" / "result.json")["global_step"] == 20
    resumed = _losses(run / "logs" / "island0" / "metrics.csv")
    assert len(resumed) == 4, "the resumed run trains only the 4 remaining steps"


@pytest.mark.slow
def test_main_job_runs_and_prints_its_summary(fsdp_then_islands):
    """The default job (two heterogeneous islands): here the one that starts from the FSDP checkpoint."""
    out, run = fsdp_then_islands["islands"]
    assert "=== lightning-islands summary ===" in out
    summary = _json(run / "summary.json")
    assert summary["strategy"] == "islands" and summary["rounds"] == 2  # 6 steps after the checkpoint's 16, H=3
    assert [r["world_size"] for r in summary["islands"]] == [2, 1]
    losses = summary["val_loss_per_island"]
    # same global model on every island; only the split of the validation set over ranks differs
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert summary["bytes_exchanged"] > 0
    # what the same run would send with fp32 pseudo-gradients, and with synchronous data parallelism
    n = summary["parameters"]["total"]
    assert summary["bytes_fp32"] == 2 * 2 * 4 * n, "2 rounds, each island sending 4 bytes a parameter to the other"
    assert summary["bytes_sync_dp"] == 6 * 8 * n, "6 steps trained, 8 bytes a parameter cross the cut per step"
    assert summary["bytes_exchanged"] < summary["bytes_fp32"] / 7, "the default exchange is quantized (int4)"
    assert "bytes vs fp32" in out and "bytes vs sync DP" in out
    # logged to W&B (offline) only, the run's own history gives every plot
    assert not (run / "logs").exists() and len(list((run / "wandb").glob("offline-run-*"))) == 2
    drawn = {Path(p).name for p in summary["plots"]}
    assert drawn == {"val_loss_vs_tokens.png", "val_loss_vs_time.png", "loss_vs_bytes.png", "rounds.png"}, drawn
    assert all(Path(p).stat().st_size > 0 for p in summary["plots"])
    assert str(run / "report" / "loss_vs_bytes.png") in out
    assert (run / "island0" / "checkpoints" / "last.ckpt").is_dir()
    for island in (0, 1):  # the last round at the end of the fit: what resume=RUN_FOLDER finds
        assert sorted(p.name for p in (run / f"island{island}" / "checkpoints").glob("round*")) == ["round000002.ckpt"]
    for island in (0, 1):  # a callback from the command line saw the last round's metrics
        seen = _json(run / f"seen{island}.json")
        assert seen["islands/round"] >= 1.0 and seen["islands/round_tokens"] > 0


@pytest.mark.slow
def test_a_plain_fsdp_checkpoint_seeds_the_islands(fsdp_then_islands):
    _, run = fsdp_then_islands["islands"]
    for island in (0, 1):
        result = _json(run / f"island{island}" / "result.json")
        assert result["global_step"] == 22
        # the training loop (6 batches, their rounds) is within the fit, which also meets and validates
        assert 0 < result["loop_seconds"] < result["fit_seconds"]
    assert _json(run / "summary.json")["rounds"] == 2, "only the 6 steps after the checkpoint's 16 are trained"
    fsdp_val = _json(fsdp_then_islands["fsdp"][1] / "summary.json")["val_loss"]
    seeded = _json(run / "summary.json")["val_loss_per_island"][0]
    # 6 steps from random weights land far above (~4.7); from the checkpoint they continue its curve
    assert seeded < fsdp_val + 0.15, (seeded, fsdp_val)


@pytest.mark.slow
def test_multirun_sweep_of_two_jobs(finished_runs):
    """``lightning-islands train -m`` runs one launch per job of the sweep (see conftest.finished_runs)."""
    summaries = sorted(finished_runs.glob("sweep_h/multirun_*/*/summary.json"))
    assert len(summaries) == 2
    jobs = [OmegaConf.load(p.parent / "job.yaml") for p in summaries]
    assert sorted(job.islands.sync_every for job in jobs) == [2, 4]
    rounds = sorted(_json(p)["rounds"] for p in summaries)
    assert rounds == [1, 2]  # 4 steps / H


@pytest.mark.slow
def test_moe_expert_weighting_with_time_balanced_slow_island(moe_and_ddp):
    run = moe_and_ddp["moe"]
    summary = _json(run / "summary.json")
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
def test_ddp_with_wandb_runs(moe_and_ddp):
    run = moe_and_ddp["ddp"]
    summary = _json(run / "summary.json")
    assert summary["strategy"] == "ddp" and summary["islands"][0]["global_step"] == 4
    assert summary["islands"][0]["world_size"] == 2
    offline_runs = list((run / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1, "one offline W&B run for the island"


@pytest.mark.slow
def test_single_strategy_runs(finished_runs):
    summaries = [p for p in finished_runs.rglob("summary.json") if "sweep_h" not in str(p)]
    assert len(summaries) == 1
    summary = _json(summaries[0])
    assert summary["strategy"] == "single" and summary["islands"][0]["global_step"] == 4
    assert summary["islands"][0]["world_size"] == 1


def test_tensorboard_logger_writes_events_in_the_run_folder(tmp_path):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["logger=tensorboard"])
    (logger,) = build_loggers(cfg, tmp_path, 1)
    logger.log_metrics({"train/loss": 1.0}, step=0)
    logger.finalize("success")
    assert list((tmp_path / "tb" / "island1").glob("events.out.tfevents.*"))


def test_wandb_groups_a_launch_and_names_each_island_a_job_type_beside_other_loggers(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["logger=[csv,wandb]", "experiment.name=exp"])
    launch = tmp_path / "2026-12-06_07-00-00"
    csv_logger, wandb_logger = build_loggers(cfg, launch, 1)
    assert Path(csv_logger.log_dir) == launch / "logs" / "island1"
    init = wandb_logger._wandb_init
    assert (init["group"], init["job_type"], init["name"]) == ("exp-2026-12-06_07-00-00", "island1", "exp-island1")
    assert init["config"]["islands"]["codec"] == "int4", "the whole job is the W&B run's config"
    assert isinstance(init["config"]["model"], dict), "as data: nothing in it is instantiated"


def test_membership_settings_and_restarts_reach_the_strategy_and_the_launcher(tmp_path, monkeypatch):
    _, strategy = _one_island_strategy(["islands.min_islands=1", "islands.grace_s=7"])
    assert (strategy.settings.min_islands, strategy.settings.grace_s) == (1, 7)
    with pytest.raises(ValueError, match=r"min_islands must be an int >= 1 \(islands.min_islands\), got 0"):
        _one_island_strategy(["islands.min_islands=0"])
    from lightning_islands.app.launch import torchrun_command
    from lightning_islands.app.worker import restart_checkpoint

    assert "--max-restarts=3" in torchrun_command(1, ["python", "x.py"], 1234, max_restarts=3)
    (tmp_path / "last.ckpt").mkdir()
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restart_checkpoint(tmp_path) is None, "a first start resumes only from `resume`"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restart_checkpoint(tmp_path) == str(tmp_path / "last.ckpt")
    assert restart_checkpoint(tmp_path / "none") is None, "restarted before its first checkpoint: from nothing"
    (tmp_path / "round000004.ckpt").mkdir()  # newer than last.ckpt: the folder of rounds, the strategy takes it
    os.utime(tmp_path / "last.ckpt", (1, 1))
    assert restart_checkpoint(tmp_path) == str(tmp_path)
    (tmp_path / "last.ckpt").rename(tmp_path / "last.ckpt.previous")  # a save cut between its renames
    os.utime(tmp_path / "last.ckpt.previous", (10, 10))
    os.utime(tmp_path / "round000004.ckpt", (1, 1))
    assert restart_checkpoint(tmp_path) == str(tmp_path / "last.ckpt")


def test_a_members_parallelism_reaches_its_strategy_and_the_experiment_composes():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=mixed_parallel"])
    assert [(m.devices, m.batch_size, m.tensor_parallel_size) for m in cfg.islands.members] == [(2, 16, 2), (1, 16, 1)]
    os.environ.pop("LI_COORDINATOR", None)
    cfg.islands.members = [cfg.islands.members[0]]
    strategy = build_strategy(cfg, 0, island_member(cfg, 0))
    assert (strategy._tensor_parallel_size, strategy.expert_parallel_size) == (2, 1)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["strategy=fsdp", "strategy.expert_parallel_size=2"])
    fsdp = build_strategy(cfg, 0, island_member(cfg, 0))
    assert (fsdp._tensor_parallel_size, fsdp.expert_parallel_size) == (1, 2)


def test_a_free_port_lies_below_the_range_connections_take_their_source_ports_from():
    from lightning_islands.app.launch import _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(0 < p < 65536 for p in ports)
    if low > 11024:  # Linux: outgoing connections cannot take these ports before the island binds them
        assert all(low - 10000 <= p < low for p in ports), (low, ports)


class _RunsCode:
    """Unpickling it would run ``touch`` (what a hostile meta.pt could do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_resume_path_is_checked_without_running_what_its_metadata_holds(tmp_path):
    """The launcher reads a resume folder's meta.pt (is it one island's checkpoint?) with
    ``weights_only``: plain data is read, an object that would run code is refused by name."""
    from lightning_islands.app.worker import resume_path

    one = tmp_path / "island0.ckpt"
    one.mkdir()
    torch.save({"global_step": 4, "islands": {"round": 1}}, one / "meta.pt")
    with pytest.raises(ValueError, match=r"is one island's checkpoint; give one per island"):
        resume_path(str(one), 0, 2, "islands")
    plain = tmp_path / "fsdp.ckpt"
    plain.mkdir()
    torch.save({"global_step": 4, "loops": {}}, plain / "meta.pt")
    assert resume_path(str(plain), 1, 2, "islands") == str(plain), "a plain checkpoint every island starts from"
    rounds = tmp_path / "run" / "island1" / "checkpoints"  # a run's folder: its round checkpoints
    rounds.mkdir(parents=True)
    with pytest.raises(ValueError, match=r"holds no round checkpoints.*trainer.checkpoint_every_n_rounds"):
        resume_path(str(tmp_path / "run"), 1, 2, "islands")
    (rounds / "round000003.ckpt").mkdir()
    assert resume_path(str(tmp_path / "run"), 1, 2, "islands") == str(rounds)
    hostile = tmp_path / "hostile.ckpt"
    hostile.mkdir()
    marker = tmp_path / "ran"
    torch.save({"global_step": 4, "x": _RunsCode(marker)}, hostile / "meta.pt")
    with pytest.raises(ValueError, match=r"hostile.ckpt/meta.pt holds more than tensors and plain data"):
        resume_path(str(hostile), 0, 2, "islands")
    assert not marker.exists(), "nothing in the file ran"
