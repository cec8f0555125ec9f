"""Sites that come and go: a new island joins a running run, another retires for good.

Islands are threads of this test with real :class:`~lightning_islands.link.island_link.IslandLink`s
and gloo lanes, on either coordinator: a c10d TCPStore and a real etcd member. Two islands start;
a third, with an index beyond theirs and settings of its own, joins: it adopts the run's settings
from the coordinator and the global state at the round that takes it in. Island 1 then retires
(``on_end="leave"``): its last round counts and no later round waits for it, which the test makes
visible with a grace window longer than the round's deadline (a wait for it would end the run with
``DeadlinePassed``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
import torch
from doubles import run_threads
from test_engine import SPECS, initial_flat
from test_membership import _train

from lightning_islands.app.etcd_cluster import LocalEtcdCluster
from lightning_islands.engine import CanonicalLayout, IslandEngine, IslandSettings
from lightning_islands.engine.rendezvous import RUN_RECORD
from lightning_islands.link.coordinator import Coordinator, connector
from lightning_islands.link.island_link import IslandLink
from lightning_islands.link.membership import Membership

# a retired island waited for would hold a round for grace_s; the round's deadline ends the run first
GRACE_S, DEADLINE_S = 120.0, 30.0
RUN = IslandSettings(sync_every=3, outer_lr=0.7, outer_momentum=0.9, codec="int8", grace_s=GRACE_S,
                     deadline_s=DEADLINE_S)


@pytest.fixture(params=["tcpstore", "etcd"])
def coordinator(request, tmp_path):
    if request.param == "tcpstore":
        server = Coordinator()  # held: the store lives as long as this object
        yield server.address
        return
    with LocalEtcdCluster(1, data_dir=tmp_path) as cluster:
        yield cluster.address


def _link(address: str, i: int, run_id: str, join: bool = False) -> IslandLink:
    return IslandLink(address, i, 2, run_id=run_id, lanes=2, grace_s=GRACE_S, join=join,
                      deadline=timedelta(seconds=DEADLINE_S))


def _engine(settings: IslandSettings, i: int, n: int) -> tuple[IslandEngine, list[torch.Tensor]]:
    layout = CanonicalLayout(SPECS)
    engine = IslandEngine(settings, layout, i, n, torch.device("cpu"), torch.device("cpu"))
    return engine, [layout.shard_of(initial_flat(i), k).clone() for k in range(len(SPECS))]


class _Rounds(dict):
    """Global states by round; ``reached`` is set once round ``at`` is in."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.reached = at, threading.Event()

    def __setitem__(self, round_: int, value: Any) -> None:
        super().__setitem__(round_, value)
        if round_ >= self.at:
            self.reached.set()


def _await_enrolment(address: str, run_id: str) -> None:
    """Wait until island 2 is on the run's roster (it enrolled): the next decision takes it in."""
    m = Membership(connector(address, timedelta(seconds=30))(), run_id, 9, 10, 1, GRACE_S, None, lambda i: None,
                   joining=True)
    deadline = time.monotonic() + 60
    while 2 not in m.roster:
        assert time.monotonic() < deadline, "island 2 never enrolled"
        m.read_enrolments()
        time.sleep(0.02)


def test_a_third_island_joins_a_running_run_and_another_retires(coordinator):
    run_id = "sites"
    results = {0: _Rounds(2), 1: _Rounds(99), 2: _Rounds(99)}
    seen: dict[str, Any] = {}

    def starter(i: int) -> None:
        link = _link(coordinator, i, run_id)
        settings = RUN if i == 0 else replace(RUN, on_end="leave")
        engine, locals_ = _engine(settings, i, 2)
        engine.meet(lambda: link, engine.fingerprint(False))
        engine.adopt_initial_state(locals_, {})
        _train(engine, locals_, i, 2, results[i], pause=0.02, end=False)
        _await_enrolment(coordinator, run_id)
        # island 1 ends its training after round 6 and retires; island 0 trains on to round 10
        _train(engine, locals_, i, 6 if i == 1 else 10, results[i], pause=0.02)
        if i == 0:
            seen.update(retired=set(link.membership.retired), last=link.decision, roster=link.roster,
                        metrics=dict(engine.last_round_metrics))
        link.close()

    def joiner() -> None:
        results[0].reached.wait(60)
        link = _link(coordinator, 2, run_id, join=True)
        own = IslandSettings(sync_every=5, outer_lr=0.3, codec="fp32", grace_s=GRACE_S, steps_per_round=2)
        settings = own.adopt(link.read_object(RUN_RECORD, 30)["settings"])
        seen["adopted"] = settings
        engine, locals_ = _engine(settings, 2, 3)
        engine.meet(lambda: link, engine.fingerprint(False), joining=True)
        engine.state.set_anchors(locals_)  # its own parameters stand in until the round that takes it in
        _, stop = engine.rejoin(locals_)
        results[2][engine.schedule.round] = engine.global_flat().clone()
        if not stop:
            _train(engine, locals_, 2, 10, results[2])
        link.close()

    run_threads([lambda: starter(0), lambda: starter(1), joiner])

    adopted = seen["adopted"]
    assert (adopted.sync_every, adopted.outer_lr, adopted.codec) == (3, 0.7, "int8"), "the run's settings"
    assert adopted.steps_per_round == 2, "its own per-island setting stays"
    joined, left = min(results[2]), max(results[1])
    assert 3 <= joined <= left, f"island 2 joined at round {joined}, island 1 left after round {left}"
    assert left == 6 and sorted(results[0]) == list(range(1, 11)), "island 0 trained every round to the end"
    assert sorted(results[2]) == list(range(joined, 11)), "island 2 trained every round from its first"
    for i in (1, 2):
        for r in results[i]:
            assert torch.equal(results[0][r], results[i][r]), f"round {r}: islands 0 and {i} differ"
    assert seen["retired"] == {1} and seen["roster"] == (0, 2)
    assert seen["last"].present == (0, 2) and 1 in seen["last"].retired
    assert seen["metrics"]["islands/islands_left_out"] == 0.0, "a retired island is not left out: it left"


def test_processes_a_third_island_joins_with_the_runs_settings_and_another_retires(tmp_path):
    """Real processes (the Trainer, IslandStrategy, gloo) with a secret: islands 0 and 1 start;
    once round 2 counted island 2 starts, and they hold after step 6 until it asked to join. Island
    2 (``LI_JOIN=1``, its own H and codec) adopts the run's settings from the sealed record and the
    global state at its first round; island 1 retires after its 8 steps (``on_end=leave``) and
    island 0 trains on to 16. Every round bit-identical among the islands in it; no process fails."""
    import os
    import subprocess
    import sys

    from conftest import SCRIPTS

    server = Coordinator()
    out = tmp_path / "out"
    common = ["--out", str(out), "--H", "2", "--codec", "fp32", "--steps", "16,8,100", "--on-end", "stop,leave,stop",
              "--batch-sizes", "4,8,4", "--hold-for-rejoin", "6", "--rejoiner", "2", "--delays", "0.05"]
    # one process an island: its own store on a port the kernel picks (a free port picked ahead could be
    # taken by another test's process before the island binds it)
    env = {**os.environ, "LI_COORDINATOR": server.address, "LI_NUM_ISLANDS": "2", "LI_RUN_ID": "sites",
           "LI_SECRET": "a-shared-secret-of-this-test", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    env.pop("LI_JOIN", None)
    procs = []
    for i in range(3):
        while i == 2 and not (out / "island0_round2.pt").exists():  # the run is under way
            assert procs[0].poll() is None, procs[0].communicate()[0][-4000:]
            time.sleep(0.05)
        args = common if i < 2 else [*common, "--H", "5", "--codec", "int8"]  # the joiner's own settings
        island_env = {**env, "LI_ISLAND": str(i), **({"LI_JOIN": "1"} if i == 2 else {})}
        procs.append(subprocess.Popen([sys.executable, str(SCRIPTS / "islands_regression.py"), *args],
                                      env=island_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for i, (p, output) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"island {i}:\n{output[-4000:]}"
    rounds = {i: {int(f.stem.split("round")[1]): torch.load(f) for f in out.glob(f"island{i}_round*.pt")}
              for i in range(3)}
    assert sorted(rounds[0]) == list(range(1, 9)), "island 0 trained its 16 steps, 8 rounds"
    assert sorted(rounds[1]) == list(range(1, 5)), "island 1 left after its 8 steps, 4 rounds"
    joined = min(rounds[2])
    assert 3 <= joined <= 4 and sorted(rounds[2]) == list(range(joined, 9)), outputs[2][-6000:]
    for i in (1, 2):
        for r, saved in rounds[i].items():
            assert saved["digest"] == rounds[0][r]["digest"], f"round {r}: islands 0 and {i} differ"
            for name, value in saved["params"].items():
                assert torch.equal(value, rounds[0][r]["params"][name]), f"round {r}: {name} of island {i}"
    assert [rounds[0][r]["metrics"]["islands/islands_present"] for r in (5, 6, 7, 8)] == [2.0] * 4
    assert rounds[0][4]["metrics"]["islands/islands_present"] == 3.0
    assert "joins run 'sites' with its settings (changed here:" in outputs[2], outputs[2][-3000:]
