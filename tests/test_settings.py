"""One source of settings: the type, its reference page, the Hydra group, the strategy and the
planner agree; bad settings are refused, by name, before any island starts."""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_islands.app import cli, train
from lightning_islands.app.settings import IslandsConfig, Member, check_islands, settings_reference
from lightning_islands.app.train import config_dir
from lightning_islands.engine import IslandSettings
from lightning_islands.plan.config import inputs_from_islands
from lightning_islands.plan.inputs import LinkSpec, PlanInputs
from lightning_islands.strategy import IslandStrategy

ROOT = Path(__file__).resolve().parents[1]
# what the default job (conf/islands/two_hetero.yaml) tunes for its 300 steps, saying why there
PINNED_BY_THE_DEFAULT_JOB = {"sync_every": 25, "outer_momentum": 0.5}


def _composed(overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=overrides or [])


def test_the_settings_reference_is_generated_from_the_types():
    page = (ROOT / "docs" / "SETTINGS.md").read_text()
    assert page == settings_reference(), (
        "docs/SETTINGS.md is out of date: python -m lightning_islands.app.settings > docs/SETTINGS.md")
    for cls in (IslandSettings, IslandsConfig, Member):
        for f in fields(cls):
            assert f"| `{f.name}` |" in page and f.metadata["help"] in page


def test_one_set_of_defaults_in_the_type_the_strategy_the_hydra_group_and_the_planner():
    defaults = IslandSettings()
    assert defaults.codec == "int4" and defaults.use_error_feedback, "the codec the default job measured best"
    assert (defaults.outer_lr, defaults.outer_momentum, defaults.nesterov) == (0.7, 0.9, True), "DiLoCo's outer step"
    assert IslandStrategy(num_islands=1).settings == defaults
    job = IslandSettings.from_mapping(OmegaConf.to_container(_composed().islands))
    for name in IslandSettings.names():
        expected = PINNED_BY_THE_DEFAULT_JOB.get(name, getattr(defaults, name))
        assert getattr(job, name) == expected, f"islands.{name}: the job has {getattr(job, name)!r}, not {expected!r}"
    two_hetero = (ROOT / "conf" / "islands" / "two_hetero.yaml").read_text()
    for name, value in PINNED_BY_THE_DEFAULT_JOB.items():
        assert f"\n{name}: {value}\n" in two_hetero
    plan = inputs_from_islands({"members": [{"devices": 1}]}, numel=1000, step_seconds=0.1, link=LinkSpec(bps=1e9))
    bare = PlanInputs(plan.islands, numel=1000, link=LinkSpec(bps=1e9))
    for f in fields(PlanInputs):
        if f.name in IslandSettings.names():
            engine = getattr(defaults, f.name)
            engine = tuple(engine) if isinstance(engine, list) else engine
            assert getattr(plan, f.name) == getattr(bare, f.name) == engine, f.name


def test_the_strategy_takes_settings_or_their_names_and_refuses_other_names():
    s = IslandStrategy(IslandSettings(sync_every=10, codec="int2"), num_islands=1, lanes=3)
    assert (s.settings.sync_every, s.settings.codec, s.settings.lanes) == (10, "int2", 3)
    assert IslandStrategy(sync_every=8, num_islands=1).settings == IslandSettings(sync_every=8)
    with pytest.raises(TypeError, match=r"'sync_evry' \(did you mean 'sync_every'\?\)"):
        IslandStrategy(sync_evry=8, num_islands=1)
    with pytest.raises(TypeError, match=r"'link'.*the launcher's \(link, members, max_restarts\)"):
        IslandStrategy(link="1gbit", num_islands=1)


def test_numpy_numbers_are_settings_and_a_positional_h_is_named():
    import numpy as np

    s = IslandSettings(sync_every=np.int64(10), outer_lr=np.float32(0.5), nesterov=np.bool_(False))
    assert (type(s.sync_every), type(s.outer_lr), type(s.nesterov)) == (int, float, bool)
    with pytest.raises(TypeError, match=r"first argument is an IslandSettings, got 50; pass settings by name"):
        IslandStrategy(50, num_islands=1)


@pytest.mark.parametrize("values, message", [
    ({"fragments": 2.5}, "fragments must be an int (islands.fragments), got 2.5"),
    ({"sync_every": True}, "sync_every must be an int (islands.sync_every), got True"),
    ({"grace_s": "soon"}, "grace_s must be a number or null (islands.grace_s), got 'soon'"),
    ({"codec": 4}, "codec must be a string (islands.codec), got 4"),
])
def test_values_of_the_wrong_type_are_refused_not_coerced(values, message):
    with pytest.raises(ValueError) as err:
        IslandSettings(**values)
    assert message in str(err.value)
    assert IslandSettings(outer_lr=1).outer_lr == 1.0 and isinstance(IslandSettings(outer_lr=1).outer_lr, float)


@pytest.mark.parametrize("overrides, message", [
    (["islands.members=[2,1]"], "islands.members[0]"),
    (["islands.members=[{devices:1,batch:3}]"], "Key 'batch' not in 'Member'"),
    (["islands.members=[{devices:2,tensor_parallel_size:3}]"],
     "islands.members[0].tensor_parallel_size=3 must divide devices=2"),
    (["islands.members=[]"], "islands.members is empty: give one entry per island"),
    (["islands.timeout_s=null"], "Key 'timeout_s' not in 'IslandsConfig'"),
    (["+islands.timeout_s=null"], "islands.timeout_s is no longer a setting: an island without progress"),
    (["+islands.nope=1"], "islands.nope is not a setting; remove it"),
    (["islands.fragments=x"], "'x' of type 'str' could not be converted to Integer\n    full_key: islands.fragments"),
    (["islands.fragments=2.5"], "Value '2.5' of type 'float' could not be converted to Integer"),
    (["islands.grace_s=later"], "Value 'later' of type 'str' could not be converted to Float"),
    (["islands.sync_every=7", "islands.fragments=2"], "every H must be a multiple of 2"),
    (["islands.codec=int3"], "int3"),
    (["islands.max_restarts=-1"], "max_restarts must be an int >= 0 (islands.max_restarts), got -1"),
    (["hydra.run.dir={tmp}/a_file/run"], "cannot write the run folder {tmp}/a_file/run: {tmp}/a_file is a file"),
    (["+trainer.max_step=5"], "trainer.max_step is not a keyword of lightning.pytorch.Trainer"),
    (["+trainer.devices=4"], "trainer.devices is set by the app; use islands.members[i].devices"),
    (["+callbacks.lr=1"], "callbacks.lr has no _target_"),
    (["strategy=centralized", "strategy.devices=3"], "32 windows a step, which 3 data-parallel processes cannot"),
    (["+trainer.enable_checkpointing=false"], "trainer.enable_checkpointing is set by the app"),
    (["islands.members.0.steps_per_round=0"], "islands.members[0].steps_per_round must be >= 1 or null, got 0"),
    (["+callbacks.lr={_target_:lightning.pytorch.callbacks.LearningRateMonitr}"],
     "callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitr cannot be imported"),
    (["islands.link=25gbps"], "islands.link: rate '25gbps' is ambiguous"),
    (["islands.members.1.step_delay_s='0.5,0.1@x'"], "islands.members[1].step_delay_s: cannot read '0.1@x'"),
    (["islands.coordinator=localhost"], "coordinator address 'localhost' is not of the form HOST:PORT or etcd://"),
])
def test_bad_settings_end_the_app_before_any_island_starts(overrides, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "a_file").write_text("")

    def no_island(*args, **kwargs):
        raise AssertionError("an island was started")

    monkeypatch.setattr(train, "run_islands", no_island)
    monkeypatch.setattr(sys, "argv", ["lightning-islands"])
    run_dir = tmp_path / "run"
    argv = ["train", f"hydra.run.dir={run_dir}", "hydra/job_logging=none", "hydra/hydra_logging=none",
            *(o.replace("{tmp}", str(tmp_path)) for o in overrides)]
    with pytest.raises(SystemExit) as ended:
        cli.main(argv)
    assert ended.value.code not in (0, None)
    out = capsys.readouterr()
    said = f"{out.err}{out.out}{ended.value.code if isinstance(ended.value.code, str) else ''}"
    assert message.replace("{tmp}", str(tmp_path)) in said, said
    assert not (run_dir / "island0").exists() and not (run_dir / "job.yaml").exists()


def test_the_default_group_passes_the_same_check_the_driver_runs():
    checked = check_islands(_composed().islands)
    assert [(m.devices, m.batch_size) for m in checked.members] == [(2, 8), (1, 16)]
    for option in ("two_equal", "slow_island"):
        check_islands(_composed([f"islands={option}"]).islands)
