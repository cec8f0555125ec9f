"""examples/: the training script alone, as two islands under ``lightning-islands run``, and the
two-shell torchrun walk-through of examples/README.md (its commands, read from it, with free ports);
the SLURM script parsed by bash and dry-run against a stand-in ``srun``.

Real processes throughout (gloo on CPU), tiny settings: each run takes a few seconds past starting.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lightning_islands.app.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPT = EXAMPLES / "train.py"
SBATCH = EXAMPLES / "slurm_island.sbatch"
WALKTHROUGH = "## Islands on one machine, one shell each (torchrun)"
TINY = ["--text-bytes", "20000", "--accelerator", "cpu"]
FINAL = re.compile(r"island (\d+) of (\d+): (\d+) rounds, (\d+) steps, val_loss (\S+), "
                   r"global state sha256 ([0-9a-f]{64})")


def example_env() -> dict[str, str]:
    """This environment without any island identity, with this venv's commands first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LI_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LI_PROGRESS_BAR="0",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    return env


def finals(text: str) -> dict[int, tuple[int, int, int, str, str]]:
    """``{island: (islands, rounds, steps, val_loss, digest)}`` from the final lines in ``text``."""
    found = {}
    for m in FINAL.finditer(text):
        found[int(m[1])] = (int(m[2]), int(m[3]), int(m[4]), m[5], m[6])
    return found


def run(cmd: list[str], timeout: float = 240) -> str:
    done = subprocess.run(cmd, cwd=ROOT, env=example_env(), capture_output=True, text=True, timeout=timeout)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    return out


@pytest.mark.slow
def test_the_script_alone_is_one_island_without_a_coordinator():
    out = run([sys.executable, str(SCRIPT), "--max-steps", "4", "--sync-every", "2", *TINY])
    assert set(finals(out)) == {0}
    assert finals(out)[0][:3] == (1, 2, 4)


def walkthrough_commands() -> list[str]:
    """The shell commands of the README's walk-through: coordinator, island 0, island 1."""
    text = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    section = text.split(WALKTHROUGH, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    commands = [" ".join(line for line in b.splitlines() if not line.startswith("#")).strip() for b in blocks]
    assert len(commands) == 3 and all(b.startswith(f"# shell {i}") for i, b in enumerate(blocks, 1)), blocks
    return commands


class Proc:
    """A command run by bash in its own process group, its output in ``log``."""

    def __init__(self, command: str, log: Path | None) -> None:
        self.log = log
        self.proc = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=example_env(), text=True,
                                     stdout=subprocess.PIPE if log is None else log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def wait_for_listening(coordinator: Proc, timeout: float = 60) -> int:
    """The coordinator's port, from its "listening" line; stops it and fails if none comes in ``timeout``."""
    timer = threading.Timer(timeout, coordinator.stop)  # readline below returns "" once it is stopped
    timer.start()
    try:
        for line in iter(coordinator.proc.stdout.readline, ""):
            m = re.search(r"coordinator listening on \S+:(\d+)", line)
            if m:
                return int(m[1])
    finally:
        timer.cancel()
    raise AssertionError(f"the coordinator ended (exit {coordinator.proc.wait()}) before listening")


@pytest.mark.slow
def test_two_shell_torchrun_walkthrough(tmp_path):
    coordinator_cmd, *island_cmds = walkthrough_commands()
    assert coordinator_cmd == "lightning-islands coordinator --port 29400"
    coordinator = Proc(coordinator_cmd.replace("--port 29400", "--port 0"), None)
    islands: list[Proc] = []
    try:
        port = wait_for_listening(coordinator)
        for i, cmd in enumerate(island_cmds):
            assert "LI_COORDINATOR=127.0.0.1:29400" in cmd and f"LI_ISLAND={i}" in cmd
            cmd = re.sub(r"--master-port \d+", f"--master-port {free_port()}", cmd)
            islands.append(Proc(cmd.replace("127.0.0.1:29400", f"127.0.0.1:{port}"), tmp_path / f"island{i}.log"))
        codes = [p.proc.wait(timeout=240) for p in islands]
    finally:
        for p in [*islands, coordinator]:
            p.stop()
    logs = [p.log.read_text() for p in islands]
    assert codes == [0, 0], "\n".join(log[-4000:] for log in logs)
    got = [finals(log) for log in logs]
    assert set(got[0]) == {0} and set(got[1]) == {1}
    (islands, rounds, steps, loss, digest), other = got[0][0], got[1][1]
    assert (islands, rounds, steps, digest) == (other[0], other[1], other[2], other[4])  # bit-identical states
    assert (islands, rounds, steps) == (2, 3, 60)
    # the same model and data, but a mean over 2 ranks against one over 1: equal up to rounding
    assert float(loss) == pytest.approx(float(other[3]), abs=2e-4)


def test_slurm_script_parses():
    done = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_slurm_script_dry_run_exports_the_island_and_runs_the_example(tmp_path, monkeypatch):
    stub = tmp_path / "bin"
    stub.mkdir()
    # a stand-in srun: keeps what it would start and the island's environment
    (stub / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$OUT/args"\n'
                               'env | grep "^LI_" | sort > "$OUT/env"\n')
    (stub / "srun").chmod(0o755)
    env = {**example_env(), "PATH": f"{stub}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path),
           "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_NUM_NODES": "2"}
    missing = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert missing.returncode != 0 and "ISLAND" in missing.stderr
    env.update(ISLAND="1", COORDINATOR_HOST="10.8.0.1", RUN_ID="exp7")
    done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    exported = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines())
    assert {k: exported[k] for k in ("LI_ISLAND", "LI_NUM_ISLANDS", "LI_COORDINATOR", "LI_RUN_ID")} == {
        "LI_ISLAND": "1", "LI_NUM_ISLANDS": "2", "LI_COORDINATOR": "10.8.0.1:29400", "LI_RUN_ID": "exp7"}
    args = (tmp_path / "args").read_text().split()
    assert args[:2] == ["python", "examples/train.py"] and (ROOT / args[1]).is_file()
    spec = importlib.util.spec_from_file_location("example_train", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(sys, "argv", args[1:])  # the example accepts what the batch script passes
    parsed = example.parse_args()
    assert (parsed.accelerator, parsed.devices, parsed.num_nodes) == ("gpu", 8, 2)
