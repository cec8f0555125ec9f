"""The launcher's processes: islands that are never restarted run without torchrun's agent."""

from __future__ import annotations

import sys

from lightning_islands.app import launch

# Island 0's rank 1 fails once its rank 0 has started (it marks a file): both have printed by then.
FAILING_RANK = """import os, pathlib, sys, time
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "master", os.environ["MASTER_PORT"], flush=True)
started = pathlib.Path(sys.argv[0]).with_suffix(".started" + os.environ["LI_ISLAND"])
if os.environ["RANK"] == "0":
    started.touch()
if os.environ["LI_ISLAND"] == "0" and os.environ["RANK"] == "1":
    while not started.exists():
        time.sleep(0.01)
    sys.exit(3)
time.sleep(600)  # until the launcher stops it
"""


def test_a_failing_rank_stops_its_islands_other_ranks_and_the_other_islands(tmp_path):
    """Island 0 (2 processes): rank 1 exits 3; its rank 0, which would sleep 600 s, is stopped as
    torchrun's agent would stop it, the island ends with 3, and island 1 is stopped too."""
    script = tmp_path / "failing_rank.py"
    script.write_text(FAILING_RANK)
    assert launch.island_command(2, ["python", str(script)], 1234)[0] == [sys.executable, str(script)]
    assert launch.island_command(1, ["python", str(script)], 1234)[1][0]["MASTER_PORT"] == "0"  # no port to race for
    assert launch.island_command(2, ["python", str(script)], 1234, max_restarts=1)[0][1:3] == \
        ["-m", "torch.distributed.run"]
    results = launch.run_islands([2, 1], [sys.executable, str(script)], log_dir=tmp_path / "logs", live=False)
    assert [(r.returncode, r.stopped) for r in results] == [(3, False), (-15, True)]
    log = (tmp_path / "logs" / "island0.log").read_text()
    ports = {line.split()[-1] for line in log.splitlines() if line.startswith("rank")}
    assert sorted(line.split(" master")[0] for line in log.splitlines() if line.startswith("rank")) == \
        ["rank 0 of 2", "rank 1 of 2"] and len(ports) == 1


def test_a_rank_that_outlives_its_sigterm_is_killed(tmp_path, monkeypatch):
    """As torchrun's agent does after its grace: the rank that ignores SIGTERM ends by SIGKILL."""
    monkeypatch.setattr(launch, "TERMINATE_GRACE_S", 0.5)
    script = tmp_path / "deaf_rank.py"
    script.write_text("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + FAILING_RANK)
    results = launch.run_islands([2, 1], [sys.executable, str(script)], log_dir=tmp_path / "logs", live=False)
    assert [(r.returncode, r.stopped) for r in results] == [(3, False), (-9, True)]


def test_ports_picked_together_are_all_different():
    for _ in range(20):
        ports = launch.free_ports(40)
        assert len(set(ports)) == 40
