"""Shared fixtures: run islands as real torch.distributed.run processes on this machine, and the
finished runs of the Hydra app that tests/test_app.py and tests/test_report.py both read."""

from __future__ import annotations

import io
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lightning_islands.app.launch import report_failures, run_islands

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(autouse=True, scope="session")
def _quiet_env():
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torch's store clients look up their peer's name; a lost DNS query costs glibc's 5 s timeout
    os.environ.setdefault("RES_OPTIONS", "timeout:1")
    yield


def launch(islands, args, log_dir, expect_ok=True, live=False):
    """Run tests/scripts/<args[0]> as islands; returns (results, combined output). ``live=True``: the
    launcher's live status lines instead of the islands' interleaved output (which goes to the log
    files only)."""
    buf = io.StringIO()
    results = run_islands(islands, [sys.executable, str(SCRIPTS / args[0]), *map(str, args[1:])],
                          log_dir=log_dir, live=live, out=buf, env={"OMP_NUM_THREADS": "1"})
    text = buf.getvalue()
    if expect_ok and any(r.returncode != 0 for r in results):
        err = io.StringIO()
        report_failures(results, err)
        raise AssertionError(f"islands failed:\n{err.getvalue()}\n--- output ---\n{text[-6000:]}")
    return results, text


class SharedLaunches:
    """``runs(name)``: the result of the launch named ``name``, made the first time a test asks for
    it together with the rest of its group (of ``groups``) and shared by every later test that asks;
    ``runs.launches[name]``: its ``(results, output, seconds)``. ``job(name, runs)`` gives a launch's
    ``(launch arguments, launch keywords, result)``; it may ask ``runs`` for the launches it needs
    first (a resume), and its error, or the launch's, fails only the tests that ask for that name.
    Launches cost seconds of CPU in each process and mostly wait: a group's run at once (on 2 cores
    two at a time take less time than one after the other; more starve islands)."""

    def __init__(self, groups: list[tuple[str, ...]], job) -> None:
        self.groups, self.job = groups, job
        self.outcomes: dict = {}
        self.launches: dict = {}

    def __call__(self, name: str):
        if name not in self.outcomes:
            jobs = {}
            for n in next(g for g in self.groups if name in g):
                try:
                    jobs[n] = self.job(n, self)
                except BaseException as err:  # noqa: BLE001 - a launch it needs failed
                    self.outcomes[n] = err
            threads = [threading.Thread(target=self._launch, args=(n, *jobs[n])) for n in jobs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if isinstance(self.outcomes[name], BaseException):
            pytest.fail(f"the {name} run failed:\n{self.outcomes[name]}")
        return self.outcomes[name]

    def _launch(self, name: str, args: tuple, kwargs: dict, result) -> None:
        try:
            started = time.monotonic()
            results, text = launch(*args, **kwargs)
            self.launches[name] = (results, text, time.monotonic() - started)
            self.outcomes[name] = result
        except BaseException as err:  # noqa: BLE001 - reported by the tests that ask for this launch
            self.outcomes[name] = err


def launch_together(*jobs):
    """:func:`launch` several independent runs at once, each ``(islands, args, log_dir)``; returns
    their ``(results, output)`` in order. On 2 cores two launches at once take about 30% less time
    than one after the other (see ``train_together``)."""
    outcomes: list = [None] * len(jobs)

    def one(k: int) -> None:
        try:
            outcomes[k] = launch(*jobs[k])
        except BaseException as err:  # noqa: BLE001 - raised below, in the test's thread
            outcomes[k] = err

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes


def kill_island_process(pid: int) -> None:
    """SIGKILL an island's training process that never ends by itself (stopped or cut off) and,
    first, its torch.distributed.run agent if it has one (else the agent would restart it); an
    island of one process that is never restarted runs without an agent (launch.island_command)."""
    parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    try:
        agent = b"torch.distributed.run" in Path(f"/proc/{parent}/cmdline").read_bytes()
    except OSError:
        agent = False
    if agent:
        os.kill(parent, signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)


def load_rounds(out: Path, island: int) -> dict[int, dict]:
    """``{round: saved}`` for one island of an islands_regression run."""
    rounds = {}
    for p in sorted(out.glob(f"island{island}_round*.pt")):
        saved = torch.load(p, weights_only=False)
        rounds[saved["round"]] = saved
    return rounds


# The app's jobs in tests train a small MoE (0.25 M parameters, 4 experts) on windows of 64 bytes:
# a step takes a few tens of ms on a loaded CPU, so a launch costs little more than starting its
# processes, and the loss still falls by more than a nat in 16 steps.
TINY_MODEL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.d_ff=128", "model.n_experts=4",
              "model.seq_len=64", "model.warmup_steps=4"]
# ...on a small corpus (one cache for every job of the session) with a small validation set.
TINY_DATA = ["data.max_bytes=300000", "data.val_windows=8", "data.val_batch_size=4"]
NO_CHECKPOINTS = ["trainer.checkpoint_every_n_steps=0", "trainer.checkpoint_every_n_rounds=0"]
# The jobs of `finished_runs`: 4 steps, validated after 2 and 4, no checkpoints.
TINY = [*TINY_MODEL, *TINY_DATA, "trainer.max_steps=4", "trainer.val_check_interval=2", *NO_CHECKPOINTS]


@pytest.fixture(scope="session")
def app_env(tmp_path_factory):
    """The environment of the app's subprocesses: one corpus cache for the session, W&B offline,
    one thread per process."""
    env = dict(os.environ)
    env["LIGHTNING_ISLANDS_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    env["WANDB_MODE"] = "offline"
    env["OMP_NUM_THREADS"] = "1"
    return env


class Driver:
    """One run of the Hydra driver in a subprocess, its output going to a log file in ``cwd``."""

    _count = itertools.count()

    def __init__(self, args, cwd, env, via_cli=False):
        module = ["lightning_islands.app.cli", "train"] if via_cli else ["lightning_islands.app.train"]
        self.log = Path(cwd) / f"driver{next(self._count)}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", *module, *map(str, args)], cwd=cwd, env=env,
                                         stdout=out, stderr=subprocess.STDOUT)

    def finish(self, timeout=600) -> str:
        """Wait for the run; returns its output, fails with the output's end if it failed."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.stop()
        out = self.log.read_text()
        assert self.proc.returncode == 0, out[-6000:]
        return out

    def stop(self) -> None:
        """End the run if it still runs: SIGTERM first, on which the launcher stops its islands."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def train(args, cwd, env, timeout=600, via_cli=False):
    """Run the Hydra driver (``python -m lightning_islands.app.train ARGS``, or through the CLI:
    ``python -m lightning_islands.app.cli train ARGS``) in ``cwd``; returns its output."""
    return Driver(args, cwd, env, via_cli).finish(timeout)


def train_together(jobs, env, timeout=600):
    """Run several drivers at once, ``{name: (args, cwd)}``; returns ``{name: output}``.

    On 2 cores two launches at once take about 30% less time than one after the other: much of a
    launch is waiting (for the other processes of its world, for the launcher's polls)."""
    drivers = {}
    try:
        for name, (args, cwd) in jobs.items():
            drivers[name] = Driver(args, cwd, env)
        return {name: driver.finish(timeout) for name, driver in drivers.items()}
    finally:
        for driver in drivers.values():
            driver.stop()


def run_dir_of(stdout: str) -> Path:
    """The run folder a driver's output names."""
    return Path(stdout.split("run folder ", 1)[1].split()[0])


@pytest.fixture(scope="session")
def finished_runs(tmp_path_factory, app_env):
    """A Hydra multirun of recipe sweep_h through the ``lightning-islands train`` command (2 jobs of
    two one-process islands, H=2 and H=4) and, at the same time, one ``single`` run: all finished,
    under one ``runs/`` folder. Read by the app's multirun and strategy tests and by the report's."""
    cwd = tmp_path_factory.mktemp("runs")
    single = Driver(["strategy=single", *TINY], cwd, app_env)
    try:
        # islands.sync_every replaces the recipe's H grid
        train(["-m", "experiment=sweep_h", "islands.sync_every=2,4", "islands=two_equal", *TINY], cwd, app_env,
              timeout=300, via_cli=True)
        single.finish(timeout=300)
    finally:
        single.stop()
    return cwd / "runs"


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (benchmarks are scripts, not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module
