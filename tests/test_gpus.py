"""Each island's GPUs on one machine (app/gpus.py): a fake device count, real launches."""

from __future__ import annotations

import sys

import pytest

from lightning_islands.app import gpus as G
from lightning_islands.app import launch, train
from lightning_islands.app.settings import check_islands


def test_gpu_islands_get_gpus_of_their_own_in_island_order_and_a_cpu_island_none():
    plan = G.plan_gpus([2, 1, 3], ["gpu", "cpu", "gpu"], ["0", "1", "2", "3", "4", "5", "6", "7"])
    assert [e["CUDA_VISIBLE_DEVICES"] for e in plan.env] == ["0,1", "", "2,3,4"]
    assert [e[G.ENV_ACCELERATOR] for e in plan.env] == ["gpu", "cpu", "gpu"] and plan.warning is None
    # the GPUs this process was given (its own CUDA_VISIBLE_DEVICES) are the ones handed out
    plan = G.plan_gpus([1, 1], ["auto", "auto"], ["GPU-aa", "GPU-bb"])
    assert [e["CUDA_VISIBLE_DEVICES"] for e in plan.env] == ["GPU-aa", "GPU-bb"]
    assert G.plan_gpus([1, 2], ["auto"] * 2, []).env == ({"CUDA_VISIBLE_DEVICES": "", G.ENV_ACCELERATOR: "cpu"},) * 2


def test_too_few_gpus_are_refused_with_the_numbers_unless_the_islands_share_them():
    with pytest.raises(ValueError, match=r"islands 0, 1 need 3 GPUs \(2 \+ 1 processes\) but this machine shows 2; "
                                         r"run fewer processes, put an island on the CPU .*--gpus shared"):
        G.plan_gpus([2, 1], ["gpu", "gpu"], ["0", "1"])
    shared = G.plan_gpus([2, 1], ["gpu", "gpu"], ["0", "1"], "shared")
    assert [e["CUDA_VISIBLE_DEVICES"] for e in shared.env] == ["0,1", "0,1"] and shared.warning is None
    auto = G.plan_gpus([2, 1], ["auto", "auto"], ["0", "1"])  # not asked for: shared, and said so
    assert [e["CUDA_VISIBLE_DEVICES"] for e in auto.env] == ["0,1", "0,1"] and "share them" in auto.warning
    with pytest.raises(ValueError, match="island 1 should run on GPUs, but this machine shows none"):
        G.plan_gpus([1, 1], ["cpu", "gpu"], [])
    with pytest.raises(ValueError, match="accelerator 'tpu' is not one of auto, gpu, cpu"):
        G.parse_accelerators("gpu,tpu", 2)
    with pytest.raises(ValueError, match="name 3 islands, the run has 2"):
        G.parse_accelerators("gpu,cpu,cpu", 2)
    assert G.parse_accelerators("GPU", 3) == ["gpu"] * 3 and G.parse_accelerators(None, 2) == ["auto"] * 2


SHOW = ("import os\nprint('SEEN', os.environ['LI_ISLAND'], os.environ['LOCAL_RANK'], "
        "repr(os.environ['CUDA_VISIBLE_DEVICES']), os.environ['LI_ACCELERATOR'])\n")


def test_launched_islands_see_their_own_gpus(monkeypatch, tmp_path):
    """Real launches (torchrun per island) on a machine that shows four GPUs: islands of 2 and 1 GPU
    processes and a CPU island see what the plan gave them; too many processes end before any start."""
    monkeypatch.setattr(G, "visible_gpus", lambda: ["0", "1", "2", "3"])
    show = tmp_path / "show.py"
    show.write_text(SHOW)
    command = [sys.executable, str(show)]
    results = launch.run_islands([2, 1, 1], command, log_dir=tmp_path, accelerators="gpu,gpu,cpu", live=False)
    assert [r.returncode for r in results] == [0, 0, 0]
    seen = sorted(line.split("SEEN ")[1] for i in range(3) for line in (tmp_path / f"island{i}.log").read_text()
                  .splitlines() if "SEEN " in line)
    assert seen == ["0 0 '0,1' gpu", "0 1 '0,1' gpu", "1 0 '2' gpu", "2 0 '' cpu"]
    with pytest.raises(ValueError, match=r"need 5 GPUs \(2 \+ 3 processes\) but this machine shows 4"):
        launch.run_islands([2, 3], command, log_dir=tmp_path / "refused", accelerators="gpu", live=False)
    assert not (tmp_path / "refused").exists()


def test_the_hydra_job_says_what_each_island_runs_on(monkeypatch):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=train.config_dir(), version_base="1.3"):
        cfg = compose("config", overrides=["trainer=gpu", "islands.members.1.accelerator=cpu", "islands.gpus=shared"])
        assert train.island_accelerators(cfg) == ["gpu", "cpu"] and train.gpu_sharing(cfg) == "shared"
        assert train.island_accelerators(compose("config", overrides=["strategy=fsdp"])) == ["cpu"]
        with pytest.raises(ValueError, match="islands.gpus must be own or shared, got 'mine'"):
            check_islands(compose("config", overrides=["islands.gpus=mine"]).islands)
        with pytest.raises(ValueError, match=r"islands.members\[1\].accelerator must be gpu, cpu or null, got 'tpu'"):
            check_islands(compose("config", overrides=["islands.members.1.accelerator=tpu"]).islands)


def test_run_and_train_refuse_too_few_gpus_before_anything_starts(monkeypatch, tmp_path, capsys):
    from lightning_islands.app import cli

    monkeypatch.setattr(G, "visible_gpus", lambda: ["0", "1"])

    def no_island(*args, **kwargs):
        raise AssertionError("an island was started")

    monkeypatch.setattr(launch, "run_islands", no_island)
    monkeypatch.setattr(train, "run_islands", no_island)
    with pytest.raises(SystemExit) as ended:
        cli.main(["run", "--islands", "2,1", "--accelerators", "gpu", "--", sys.executable, "x.py"])
    assert ended.value.code == 2 and "need 3 GPUs (2 + 1 processes) but this machine shows 2" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["lightning-islands"])
    with pytest.raises(SystemExit) as ended:
        cli.main(["train", f"hydra.run.dir={tmp_path / 'run'}", "hydra/job_logging=none", "hydra/hydra_logging=none",
                  "trainer=gpu", "islands.members.0.devices=2"])
    assert "need 3 GPUs (2 + 1 processes) but this machine shows 2" in str(ended.value.code)
    assert not (tmp_path / "run" / "job.yaml").exists() and not (tmp_path / "run" / "island0").exists()
