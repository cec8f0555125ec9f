"""Membership per round: islands that die are left out, islands that restart rejoin.

Islands are threads of this test with real :class:`~lightning_islands.link.island_link.IslandLink`s over
loopback (a real coordinator, real gloo lanes); the multi-process tests with real SIGKILLs and
torchrun restarts are in tests/test_islands.py.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from doubles import run_threads
from test_engine import INNER_LR, SPECS, initial_flat, target

from lightning_islands.engine import CanonicalLayout, IslandEngine, IslandSettings, RoundDriver
from lightning_islands.link import liveness
from lightning_islands.link.coordinator import Coordinator
from lightning_islands.link.island_link import IslandLink
from lightning_islands.link.membership import Decision, Membership
from lightning_islands.link.protocol import LateForRound, QuorumLost

GRACE = 1.0


def _engine(i: int, n: int, link: IslandLink, **kw: Any) -> tuple[IslandEngine, list[torch.Tensor]]:
    settings = IslandSettings(sync_every=3, outer_lr=0.7, outer_momentum=0.9, grace_s=GRACE, **kw)
    layout = CanonicalLayout(SPECS)
    engine = IslandEngine(settings, layout, i, n, torch.device("cpu"), torch.device("cpu"))
    locals_ = [layout.shard_of(initial_flat(i), k).clone() for k in range(len(SPECS))]
    return engine, locals_


def _link(coordinator: Coordinator, i: int, n: int, run_id: str, incarnation: int = 0, **kw: Any) -> IslandLink:
    return IslandLink(coordinator.address, i, n, run_id=run_id, lanes=2, grace_s=kw.pop("grace_s", GRACE),
                      incarnation=incarnation, **kw)


def test_the_member_set_is_decided_once_for_everyone():
    """Two islands propose at once; both read the same decision, and the lanes key stays while the
    members do."""
    coordinator = Coordinator()
    store = coordinator.store
    ms = [Membership(store, "m", i, 2, 1, GRACE, None, lambda i: None) for i in range(2)]
    got = run_threads([lambda m=m: m.decide(0, {"i": m.island}) for m in ms])
    assert got[0][0] == got[1][0] and got[0][0].present == (0, 1)
    assert got[0][0].lanes == "lanes", "the first round with everyone keeps the lanes opened at the start"
    assert got[0][1] == [{"i": 0}, {"i": 1}]
    for m in ms:
        m.committed = m.previous  # as if settled
    again = run_threads([lambda m=m: m.decide(1, {"i": m.island}) for m in ms])
    assert again[0][0].lanes == got[0][0].lanes, "same members: the lanes stay"


class _Counting:
    """A store client that counts the requests each operation makes (each one a round trip to the
    coordinator, which over a WAN is the latency a round pays)."""

    def __init__(self, store: Any) -> None:
        self.store, self.ops = store, {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def counted(*a: Any, **k: Any) -> Any:
            self.ops[name] = self.ops.get(name, 0) + 1
            return attr(*a, **k)
        return counted


def test_a_round_everyone_is_at_costs_the_last_island_five_requests_after_its_writes():
    """The island that arrives last reads the roster's enrolment count (one add of 0: has an island
    enrolled?), finds every header with one check, proposes with one compare_set and reads every
    header with one multi_get; settling when the others are done is one check and one compare_set.
    (Before: 12 and 4 round trips, 0.8 s a round at 100 ms.)"""
    coordinator = Coordinator()
    first = Membership(coordinator.store, "c", 0, 2, 1, GRACE, None, lambda i: None)
    last_store = _Counting(coordinator.store)
    last = Membership(last_store, "c", 1, 2, 1, GRACE, None, lambda i: None)
    box: dict[str, Any] = {}
    waiting = threading.Thread(target=lambda: box.update(d=first.decide(0, {"i": 0})))
    waiting.start()
    while not coordinator.store.check(["c/round0/a0/h/0"]):
        time.sleep(0.005)
    decision, headers = last.decide(0, {"i": 1})
    waiting.join(10)
    assert box["d"][0] == decision and headers == [{"i": 0}, {"i": 1}] == box["d"][1]
    assert last_store.ops == {"set": 1, "add": 1, "check": 1, "compare_set": 1, "multi_get": 1}
    settling = threading.Thread(target=lambda: first.settle(box["d"][0]))
    settling.start()
    while not coordinator.store.check(["c/round0/a0/done/0"]):
        time.sleep(0.005)
    last_store.ops.clear()
    last.settle(decision)
    settling.join(10)
    assert last_store.ops == {"set": 1, "check": 1, "compare_set": 1}
    assert first.committed == last.committed == decision


def test_a_silent_island_is_left_out_after_the_grace_window_and_the_quorum_holds():
    coordinator = Coordinator()
    store = coordinator.store
    m0 = Membership(store, "q", 0, 2, 1, GRACE, None, lambda i: None)
    t0 = time.monotonic()
    decision, headers = m0.decide(0, {"i": 0})
    waited = time.monotonic() - t0
    assert decision.present == (0,) and headers == [{"i": 0}, None]
    assert decision.lanes == "round0/a0", "without every island the start's lanes are not the round's"
    assert GRACE <= waited < GRACE + 1.0, f"waited {waited:.2f} s for a silent island"
    strict = Membership(store, "q2", 0, 2, 2, GRACE, None, lambda i: None)
    with pytest.raises(QuorumLost, match=r"fewer than min_islands=2.*islands.min_islands"):
        strict.decide(0, {"i": 0})


def test_without_waiting_for_slow_islands_a_majority_goes_on_after_the_grace_window():
    """max_staleness: islands 1 and 2 beat (alive, still training). Island 0 alone is no majority of
    the three and keeps waiting past the grace window; once island 1 arrives the two go on without
    island 2 after the window, and island 2, arriving later, is late for that round."""
    coordinator = Coordinator()
    store = coordinator.store
    ms = [Membership(store, "slow", i, 3, 1, GRACE, None, lambda i: None) for i in range(3)]
    for m in ms:
        m.slow_wait_s = GRACE
    beating = threading.Event()

    def beat() -> None:  # islands 1 and 2 make progress
        k = 0
        while not beating.is_set():
            k += 1
            for i in (1, 2):
                store.set(ms[0].alive_key(i), f"0:{k}")
            time.sleep(0.1)

    threading.Thread(target=beat, daemon=True).start()
    got: dict[int, Any] = {}
    first = threading.Thread(target=lambda: got.setdefault(0, ms[0].decide(0, {"i": 0})))
    first.start()
    first.join(timeout=3 * GRACE)
    assert first.is_alive(), "one island of three alive is no majority: it waits"
    t0 = time.monotonic()
    decision, headers = ms[1].decide(0, {"i": 1})
    first.join(timeout=30)
    assert decision.present == (0, 1) and headers == [{"i": 0}, {"i": 1}, None]
    assert got[0][0] == decision
    assert time.monotonic() - t0 < GRACE + 5.0
    with pytest.raises(LateForRound, match="round 0 was decided without island 2"):
        ms[2].decide(0, {"i": 2})
    beating.set()


@pytest.mark.parametrize("status, waited_for", [
    ({"round": 0, "eta_s": 300.0}, False),  # its steps left take 5 minutes: the majority goes on at once
    ({"round": -1}, False),  # still in an earlier round: it cannot make this one in time
    ({"round": 0, "eta_s": 0.05}, True),  # about to arrive: waited for (within the long wait)
    (None, True),  # nothing reported: waited for
], ids=["far", "behind", "near", "silent-status"])
def test_a_majority_waits_for_a_slow_island_only_if_its_status_says_it_arrives_in_time(status, waited_for, caplog):
    """max_staleness with a wait for slow islands of a minute: islands 0 and 1 meet round 0 while
    island 2 beats (alive) and publishes its status. A status that says it arrives later than the
    wait lets the two go on without it at once (the log says why); otherwise they wait for it, and
    it is in the round when it comes."""
    coordinator = Coordinator()
    store = coordinator.store
    ms = [Membership(store, "eta", i, 3, 1, 60.0, None, lambda i: None) for i in range(3)]
    for m in ms:
        m.slow_wait_s = 60.0
    if status is not None:
        store.set("eta/status/2", json.dumps(status))
    beating = threading.Event()

    def beat() -> None:  # island 2 makes progress
        k = 0
        while not beating.is_set():
            k += 1
            store.set(ms[0].alive_key(2), f"0:{k}")
            time.sleep(0.1)

    threading.Thread(target=beat, daemon=True).start()
    got: dict[int, Any] = {}
    pair = [threading.Thread(target=lambda i=i: got.setdefault(i, ms[i].decide(0, {"i": i}))) for i in (0, 1)]
    for t in pair:
        t.start()
    try:
        if waited_for:
            while not (store.check(["eta/round0/a0/h/0"]) and store.check(["eta/round0/a0/h/1"])):
                time.sleep(0.01)
            assert not store.check(["eta/round0/a0/members"]), "the round went on without an island about to arrive"
            decision, _ = ms[2].decide(0, {"i": 2})
            assert decision.present == (0, 1, 2) and "goes on without islands" not in caplog.text
        for t in pair:
            t.join(timeout=45)  # well inside the minute the fixed wait would take
            assert not t.is_alive(), "the majority kept waiting for an island that reported arriving late"
        if not waited_for:
            assert got[0][0].present == (0, 1)
            assert "goes on without islands [2] (they report arriving later than the wait" in caplog.text
            with pytest.raises(LateForRound):
                ms[2].decide(0, {"i": 2})
    finally:
        beating.set()


def test_a_failed_attempt_counts_for_no_island():
    """The outcome is written once: an island that finished its exchange learns that another
    failed, and the round runs again."""
    coordinator = Coordinator()
    ms = [Membership(coordinator.store, "f", i, 2, 1, GRACE, None, lambda i: None) for i in range(2)]
    decisions = run_threads([lambda m=m: m.decide(0, {})[0] for m in ms])
    ms[1].retry(decisions[1])
    from lightning_islands.link.protocol import RoundLost
    with pytest.raises(RoundLost):
        ms[0].settle(decisions[0])
    nxt = run_threads([lambda m=m: m.decide(0, {})[0] for m in ms])
    assert nxt[0] == nxt[1] and nxt[0].attempt == 1 and nxt[0].lanes != decisions[0].lanes


def _train(engine: IslandEngine, locals_: list[torch.Tensor], i: int, until: int, out: dict[int, torch.Tensor],
           pause: float = 0.0, end: bool = True) -> None:
    """Inner steps and rounds as the strategy drives them (a :class:`RoundDriver`: overlapped rounds
    land ``overlap_steps`` later) until round ``until`` is done or the islands stop; the global state
    after each round into ``out``. ``end``: round ``until`` is the end of training (synchronous, it
    stops the islands); else the island pauses once it has landed round ``until``."""
    stopped: list[bool] = []

    def landed(metrics: dict[str, float], stop: bool) -> None:
        if metrics:
            out[engine.schedule.round] = engine.global_flat().clone()
        if stop:
            stopped.append(stop)

    driver = RoundDriver(engine, lambda: locals_, on_round=landed,
                         last=lambda: end and engine.schedule.round + 1 >= until)
    while not stopped and engine.schedule.round < until:
        goal = target(i, engine.schedule.inner_steps)
        for k, loc in enumerate(locals_):
            loc.sub_(torch.mul(torch.sub(loc, engine.layout.shard_of(goal, k)), INNER_LR))
        engine.count_tokens(4 + i)
        time.sleep(pause)
        engine.link.heartbeat({"step": engine.schedule.inner_steps})  # a step is progress, as the strategy says
        driver.step_closed()


@pytest.mark.parametrize("overlap", [0, 1], ids=["sync", "overlap"])
def test_a_lost_island_is_left_out_and_a_restarted_one_rejoins_bit_identically(overlap):
    coordinator = Coordinator()
    run_id = f"rejoin{overlap}"
    kw = {"overlap_steps": overlap}
    results: dict[int, dict[int, torch.Tensor]] = {0: {}, 1: {}}
    died = threading.Event()

    def island0() -> None:
        link = _link(coordinator, 0, 2, run_id)
        engine, locals_ = _engine(0, 2, link, **kw)
        engine.meet(lambda: link, engine.fingerprint(False))
        engine.adopt_initial_state(locals_, {})
        _train(engine, locals_, 0, 2, results[0], end=False)
        died.wait(30)
        _train(engine, locals_, 0, 12, results[0], pause=0.15)
        link.close()

    def island1() -> None:
        link = _link(coordinator, 1, 2, run_id)
        engine, locals_ = _engine(1, 2, link, **kw)
        engine.meet(lambda: link, engine.fingerprint(False))
        engine.adopt_initial_state(locals_, {})
        _train(engine, locals_, 1, 2, {}, end=False)
        link.close()  # "dies": its liveness beat stops, it never sends its round-2 header
        died.set()
        time.sleep(2 * GRACE)
        link = _link(coordinator, 1, 2, run_id, incarnation=1)
        engine, locals_ = _engine(1, 2, link, **kw)
        engine.meet(lambda: link, engine.fingerprint(True), rejoining=True)
        engine.state.set_anchors(locals_)
        _, stop = engine.rejoin(locals_)
        results[1][engine.schedule.round] = engine.global_flat().clone()
        if not stop:
            _train(engine, locals_, 1, 12, results[1])
        link.close()

    run_threads([island0, island1])
    back = sorted(results[1])
    assert back and back[0] > 3, f"island 1 came back at round {back}"
    assert sorted(results[0]) == list(range(1, 13)), "island 0 trained through every round"
    assert back[-1] == 12, "island 1 trained to the end with island 0"
    for r in back:
        assert torch.equal(results[0][r], results[1][r]), f"round {r}: global states differ"


def test_a_restarted_butterfly_island_rejoins_its_groups_bit_identically():
    """Four butterfly islands; island 3 dies after round 2 (its partners mix alone meanwhile),
    restarts with a fresh state and asks to rejoin: from the round that takes it back on, it leaves
    every stage bit-identical with its partner of that stage (island 2 at stage 0, island 1 at 1)."""
    coordinator = Coordinator()
    run_id, n = "bfly-rejoin", 4
    kw = {"topology": "butterfly", "codec": "int4", "error_feedback": True}
    results: dict[int, dict[int, torch.Tensor]] = {i: {} for i in range(n)}
    died = threading.Event()

    def steady(i: int) -> None:
        link = _link(coordinator, i, n, run_id)
        engine, locals_ = _engine(i, n, link, **kw)
        engine.meet(lambda: link, engine.fingerprint(False))
        engine.adopt_initial_state(locals_, {})
        _train(engine, locals_, i, 2, results[i], end=False)
        died.wait(30)
        _train(engine, locals_, i, 12, results[i], pause=0.15)
        link.close()

    def restarted() -> None:
        link = _link(coordinator, 3, n, run_id)
        engine, locals_ = _engine(3, n, link, **kw)
        engine.meet(lambda: link, engine.fingerprint(False))
        engine.adopt_initial_state(locals_, {})
        _train(engine, locals_, 3, 2, {}, end=False)
        link.close()  # "dies": its liveness beat stops, it never sends its round-2 header
        died.set()
        time.sleep(2 * GRACE)
        link = _link(coordinator, 3, n, run_id, incarnation=1)
        engine, locals_ = _engine(3, n, link, **kw)
        engine.meet(lambda: link, engine.fingerprint(True), rejoining=True)
        engine.state.set_anchors(locals_)
        _, stop = engine.rejoin(locals_)
        results[3][engine.schedule.round] = engine.global_flat().clone()
        if not stop:
            _train(engine, locals_, 3, 12, results[3])
        link.close()

    run_threads([lambda i=i: steady(i) for i in range(3)] + [restarted])
    back = sorted(results[3])
    assert back and back[0] > 3 and back[-1] == 12, f"island 3 came back at rounds {back}"
    assert all(sorted(results[i]) == list(range(1, 13)) for i in range(3)), "the others trained through"
    for r in back:
        partner = 3 ^ (1 << ((r - 1) % 2))  # round r (1-based) ran stage (r - 1) mod 2
        assert torch.equal(results[3][r], results[partner][r]), f"round {r}: island 3 and island {partner} differ"


def test_decision_json_round_trips():
    d = Decision(3, 1, (0, 2), "round3/a1", (2,))
    assert Decision.from_json(d.to_json()) == d


def test_a_lost_coordinator_is_named_with_the_fix():
    import gc

    from lightning_islands.link.protocol import CoordinatorLost

    coordinator = Coordinator()
    address = coordinator.address
    link = _link(coordinator, 0, 2, "gone")
    del coordinator
    gc.collect()
    with pytest.raises(CoordinatorLost, match=rf"lost the coordinator at {address}.*restart the run from"):
        link.meet_round(0, {})


def test_an_island_left_behind_is_no_joiner_of_that_rounds_later_attempts():
    coordinator = Coordinator()
    m1 = Membership(coordinator.store, "late", 1, 2, 1, GRACE, None, lambda i: None)
    m1.request_join(from_round=4)  # left out of round 3: it sends its next header in round 4
    m0 = Membership(coordinator.store, "late", 0, 2, 1, GRACE, None, lambda i: None)
    assert m0.joiners(3) == {} and m0.joiners(4) == {1: 0}


def test_a_late_islands_snapshot_of_one_fragment_joins_only_that_fragments_rounds():
    """With two fragments a late island's round thread asks for round 5 or every second round on:
    the others take it into rounds 5, 7, ... only, never into another fragment's round."""
    coordinator = Coordinator()
    m1 = Membership(coordinator.store, "frag", 1, 2, 1, GRACE, None, lambda i: None)
    m1.request_join(from_round=5, every=2)
    m0 = Membership(coordinator.store, "frag", 0, 2, 1, GRACE, None, lambda i: None)
    assert [r for r in range(3, 10) if m0.joiners(r)] == [5, 7, 9]


def test_a_joiner_takes_no_decision_of_a_round_its_request_does_not_ask_for():
    """A decision left at the joiner's key from an earlier request (round 4: another fragment's) is
    dropped, not taken; the decision of round 5 is."""
    from lightning_islands.link.protocol import QuorumLost

    coordinator = Coordinator()
    m1 = Membership(coordinator.store, "stale", 1, 2, 1, GRACE, None, lambda i: None)
    m1.request_join(from_round=5, every=2)
    key = "stale/joined_at/1"
    coordinator.store.set(key, Decision(4, 0, (0, 1), "round4/a0", (1,), (0,)).to_json())
    with pytest.raises(QuorumLost):
        m1.await_inclusion(0.5)
    assert not coordinator.store.check([key]), "the stale decision is dropped"
    coordinator.store.set(key, Decision(5, 0, (0, 1), "round5/a0", (1,), (0,)).to_json())
    assert m1.await_inclusion(10.0).round == 5


def test_a_joiners_header_of_its_earlier_life_replayed_at_its_key_is_refused(caplog):
    """Island 1's second life (incarnation 1) asks to rejoin; once the round takes it in, its first
    life's header (incarnation 0; under a secret, a sealed value replayed at its very key) appears
    where the joiner's goes: island 0 refuses it, naming both incarnations, instead of merging it."""
    from lightning_islands.link.protocol import AuthenticationError

    coordinator = Coordinator()
    m0 = Membership(coordinator.store, "old", 0, 2, 1, 30.0, None, lambda i: None)
    m1 = Membership(coordinator.store, "old", 1, 2, 1, 30.0, None, lambda i: None, incarnation=1)
    coordinator.store.set(m0.alive_key(1), "1:1")  # the second life beats
    m1.request_join(0)
    got: list = []

    def decide() -> None:
        try:
            got.append(m0.decide(0, {"tokens": 1}))
        except Exception as err:  # noqa: BLE001 - the outcome is what the test looks at
            got.append(err)

    worker = threading.Thread(target=decide)
    worker.start()
    deadline = time.monotonic() + 60
    while not coordinator.store.check(["old/round0/a0/members"]):  # until the round takes island 1 in
        assert time.monotonic() < deadline, "island 0 never decided round 0"
        time.sleep(0.02)
    coordinator.store.set("old/round0/a0/h/1", json.dumps({"tokens": 7, "_inc": 0}))  # its first life's header
    worker.join(timeout=60)
    assert isinstance(got[0], AuthenticationError), got
    assert "island 0 refused island 1's round 0 header: it was written by island 1's incarnation 0" in str(got[0])
    assert "takes in its incarnation 1" in caplog.text


def test_a_member_restarted_mid_round_counts_as_lost_at_once():
    """Its new process beats, but the process that was a member is gone: the attempt fails without
    waiting out the grace window."""
    from lightning_islands.link.protocol import RoundLost

    coordinator = Coordinator()
    ms = [Membership(coordinator.store, "inc", i, 2, 1, 30.0, None, lambda i: None) for i in range(2)]
    decisions = run_threads([lambda m=m: m.decide(0, {})[0] for m in ms])
    coordinator.store.set(ms[1].alive_key(1), "1:1")  # island 1's second incarnation is beating
    t0 = time.monotonic()
    with pytest.raises(RoundLost):
        ms[0].settle(decisions[0])
    assert time.monotonic() - t0 < 5.0


class _FailsOnce:
    """A client of the coordinator whose first ``set`` fails, as a connection reset would."""

    failed = 0

    def __init__(self, store: Any) -> None:
        self.store = store

    def set(self, key: str, value: str) -> None:
        if not _FailsOnce.failed:
            _FailsOnce.failed += 1
            raise RuntimeError("injected: connection reset by peer")
        self.store.set(key, value)


def _flaky_beat(link: IslandLink, coordinator: Coordinator) -> liveness.Beat:
    """Replace ``link``'s liveness beat by one whose first ``set`` fails."""
    link.alive.stop()
    _FailsOnce.failed = 0
    connect = liveness.connector("127.0.0.1", coordinator.port, timedelta(seconds=5))
    beat = liveness.Beat(lambda: _FailsOnce(connect()), link.membership.alive_key(link.island), link.incarnation,
                         "flaky-alive")
    link.alive = beat
    return beat


def test_a_liveness_beat_that_fails_once_reconnects_logs_it_and_the_island_stays_a_member(caplog):
    """Island 1's first beat fails; it arrives at round 0 well after the grace window, beating all
    along: island 0 waits for it (both are members), and the failure and the recovery are logged.
    (A beat that ended at its first error left island 1 silent: round 0 went on without it.)"""
    coordinator = Coordinator()
    links = [_link(coordinator, i, 2, "flaky") for i in range(2)]
    beat = _flaky_beat(links[1], coordinator)
    header0 = "flaky/round0/a0/h/0"

    def late_island() -> list:
        while not coordinator.store.check([header0]):  # island 0 waits in round 0 from here on
            time.sleep(0.01)
        time.sleep(3 * GRACE)  # slow, not silent: its beat goes on
        return links[1].meet_round(0, {"i": 1})

    with caplog.at_level("WARNING", logger="lightning_islands.link.liveness"):
        got = run_threads([lambda: links[0].meet_round(0, {"i": 0}), late_island])
    assert got[0] == got[1] == [{"i": 0}, {"i": 1}] and links[0].present == (0, 1)
    assert beat.failures == 1
    assert "liveness beat 'flaky/alive/1' failed (RuntimeError: injected: connection reset by peer)" in caplog.text
    assert "liveness beat 'flaky/alive/1' goes through again" in caplog.text
    for link in links:
        link.close()


def test_an_island_left_behind_that_reaches_the_next_round_first_names_no_stale_lanes():
    """Island 1 was left out of round 1 (its process alive, but no progress for grace_s); at round 2
    it is first to see
    every header and proposes the member set. It holds no committed round (it asked to rejoin), like
    an island at the run's start, but it must not name the start's lanes: every island would then
    rebuild on rendezvous keys that hold old addresses. Real links and lanes: round 2's all-gather
    moves the bytes."""
    coordinator = Coordinator()
    links = [_link(coordinator, i, 2, "stale") for i in range(2)]
    run_threads([link.open_lanes for link in links])
    # round 0 with both: the start's lanes
    decided = run_threads([lambda link=link: (link.meet_round(0, {}), link.settle_round(), link.decision)[2]
                           for link in links])
    assert decided[0].lanes == decided[1].lanes == "lanes"
    links[0].meet_round(1, {})  # island 1's process runs but makes no progress: given up after grace_s
    links[0].settle_round()
    assert links[0].decision.present == (0,)
    from lightning_islands.link.protocol import LateForRound

    with pytest.raises(LateForRound):
        links[1].meet_round(1, {})
    # round 2: island 0's header is there before island 1 looks, so island 1 proposes at once
    coordinator.store.set("stale/round2/a0/h/0", json.dumps({"_inc": 0}))
    decision, _ = links[1].membership.decide(2, {})
    assert decision.present == (0, 1) and decision.lanes not in ("lanes", links[0].lanes_key)
    assert not links[1].membership.holds_start_lanes and links[0].membership.holds_start_lanes


def test_islands_that_come_back_after_being_left_behind_move_bytes_on_fresh_lanes():
    coordinator = Coordinator()
    # island 1's beat must not look silent while it gets back in (a loaded machine starves threads)
    links = [_link(coordinator, i, 2, "fresh", grace_s=3.0) for i in range(2)]
    run_threads([link.open_lanes for link in links])
    run_threads([lambda link=link: (link.meet_round(0, {}), link.settle_round()) for link in links])
    links[0].meet_round(1, {})  # island 1 makes no progress (its beat follows it now): left out of round 1
    links[0].settle_round()
    from lightning_islands.link.protocol import LateForRound

    with pytest.raises(LateForRound):
        links[1].meet_round(1, {})

    def round2(link: IslandLink) -> list[torch.Tensor]:
        link.meet_round(2, {})
        got = link.all_gather_bytes(torch.full((5,), link.island + 7, dtype=torch.uint8))
        link.settle_round()
        return got

    got = run_threads([lambda link=link: round2(link) for link in links])
    assert links[0].lanes_key == links[1].lanes_key != "lanes"
    for g in got:
        assert [t.tolist() for t in g] == [[7] * 5, [8] * 5]


# every position (first, middle, last) in each phase, and both island counts in each (6 of the 10 pairs)
@pytest.mark.parametrize("phase, n, silent", [("inner", 3, 0), ("inner", 3, 1), ("inner", 4, 3),
                                              ("exchange", 3, 0), ("exchange", 4, 1), ("exchange", 3, 2)],
                         ids=["inner-3-first", "inner-3-middle", "inner-4-last", "exchange-3-first",
                              "exchange-4-middle", "exchange-3-last"])
def test_a_member_that_goes_silent_in_either_phase_is_given_up_within_the_grace_window(n, silent, phase):
    """Of three or four islands, island ``silent`` stops without a reset (its beat stops, its
    payload never comes, its sockets stay open), as a stopped process or a cut link does: in its
    inner steps (it never comes to round 0's meeting) or in round 0's exchange (inside the ring
    all-gather, whether or not it is a survivor's neighbour). The others give it up within the grace
    window (not gloo's timeout) and move round 0's bytes without it on fresh lanes."""
    from lightning_islands.link.protocol import RoundLost

    coordinator = Coordinator()
    links = [_link(coordinator, i, n, f"silent-{n}-{silent}-{phase}", deadline=timedelta(seconds=20))
             for i in range(n)]
    survivors = [link for link in links if link.island != silent]
    run_threads([link.open_lanes for link in links])
    if phase == "exchange":
        run_threads([lambda link=link: link.meet_round(0, {}) for link in links])
    links[silent].alive.stop()  # no beat from here on, no meeting, no payload

    def survivor(link: IslandLink) -> tuple[float, str, list[list[int]]]:
        started, why = time.monotonic(), ""
        if phase == "exchange":
            with pytest.raises(RoundLost) as lost:
                link.all_gather_bytes(torch.full((1000,), link.island, dtype=torch.uint8))
            why = str(lost.value)
        link.meet_round(0, {})  # the exchange: attempt 1; the inner steps: attempt 0, without the silent one
        stalled = time.monotonic() - started
        got = link.all_gather_bytes(torch.full((3,), link.island, dtype=torch.uint8))
        link.settle_round()
        return stalled, why, [t.tolist() for t in got]

    results = run_threads([lambda link=link: survivor(link) for link in survivors])
    expected = [[] if i == silent else [i] * 3 for i in range(n)]
    lost = f"islands [{silent}] were lost"
    if phase == "exchange":  # whoever notices first marks the attempt failed; the others may learn it from that
        assert any(lost in why and "round 0's bytes moved" in why for _, why, _ in results)
    for stalled, why, got in results:
        if phase == "exchange":
            assert lost in why or "round 0 attempt 0 failed on another island" in why, why
        assert stalled < GRACE + 2.0, f"the survivor stalled {stalled:.1f} s (grace {GRACE} s)"
        assert got == expected
    decision = survivors[0].decision
    assert decision.present == tuple(link.island for link in survivors)
    assert decision.attempt == (1 if phase == "exchange" else 0)
    for link in links:
        link.close()


def test_a_deadlocked_training_thread_with_a_live_process_counts_as_silent_after_the_grace_window():
    """Island 1's process runs on (its liveness thread is alive) but its training thread is stuck
    after round 0: no step, no wait. Its beat follows its progress, so island 0 gives it up after
    the grace window and round 1 goes on without it."""
    coordinator = Coordinator()
    links = [_link(coordinator, i, 2, "deadlock") for i in range(2)]
    run_threads([link.open_lanes for link in links])
    run_threads([lambda link=link: (link.meet_round(0, {}), link.settle_round()) for link in links])
    stuck = threading.Event()  # island 1's training thread waits on it forever: a deadlock

    def deadlocked_island() -> None:
        stuck.wait()

    t = threading.Thread(target=deadlocked_island, daemon=True)
    t.start()
    started = time.monotonic()
    links[0].meet_round(1, {})
    waited = time.monotonic() - started
    assert links[0].decision.present == (0,), "island 1 made no progress: round 1 goes on without it"
    assert links[1].alive._thread.is_alive() and t.is_alive(), "island 1's process and its beat thread live on"
    assert GRACE <= waited < GRACE + 3.0, f"island 0 waited {waited:.1f} s (grace {GRACE} s)"
    stuck.set()


def test_a_round_past_its_deadline_ends_with_one_error_naming_the_islands_and_the_fix():
    """Island 1 keeps making progress (it steps) but never comes to round 1: island 0 waits for it,
    as for any slow island, until round 1's deadline, then ends with DeadlinePassed."""
    from lightning_islands.link.protocol import DeadlinePassed

    coordinator = Coordinator()
    links = [_link(coordinator, i, 2, "deadline", deadline=timedelta(seconds=3)) for i in range(2)]
    run_threads([link.open_lanes for link in links])
    run_threads([lambda link=link: (link.meet_round(0, {}), link.settle_round()) for link in links])
    stop = threading.Event()

    def stepping_island() -> None:
        step = 0
        while not stop.wait(0.05):
            links[1].heartbeat({"step": step})
            step += 1

    t = threading.Thread(target=stepping_island, daemon=True)
    t.start()
    started = time.monotonic()
    try:
        expected = r"round 1 did not finish within deadline_s=3 s on island 0: islands \[1\] are alive but did not "
        with pytest.raises(DeadlinePassed, match=expected + r"arrive.*raise islands.deadline_s"):
            links[0].meet_round(1, {})
    finally:
        stop.set()
        t.join(timeout=10)
    assert 3.0 <= time.monotonic() - started < 3.0 + 5.0


def test_a_transfer_past_its_deadline_with_every_member_alive_runs_the_round_again_allowing_longer():
    """Island 1 stays alive (it steps) but never sends its payload: island 0's transfer is abandoned
    at its deadline (twice the grace window for a few bytes), the attempt fails, and the next one
    assumes half the rate."""
    from lightning_islands.link import island_link
    from lightning_islands.link.protocol import RoundLost

    coordinator = Coordinator()
    links = [_link(coordinator, i, 2, "slowlink", deadline=timedelta(seconds=20)) for i in range(2)]
    run_threads([link.open_lanes for link in links])
    run_threads([lambda link=link: link.meet_round(0, {}) for link in links])
    stop = threading.Event()

    def stepping_island() -> None:
        while not stop.wait(0.05):
            links[1].heartbeat({"step": 1})

    t = threading.Thread(target=stepping_island, daemon=True)
    t.start()
    started = time.monotonic()
    try:
        with pytest.raises(RoundLost, match=r"gave up an all-gather's sizes: it took longer than its deadline"):
            links[0].all_gather_bytes(torch.full((10,), 1, dtype=torch.uint8))
    finally:
        stop.set()
        t.join(timeout=10)
    assert 2 * GRACE <= time.monotonic() - started < 2 * GRACE + 3.0
    assert links[0]._rate() == island_link.FIRST_RATE_BPS / 8 / 2, "the next attempt allows twice as long"
    assert links[0].membership._outcome(links[0].decision) == "fail"


def test_the_keys_of_rounds_long_over_are_deleted_and_an_island_that_far_behind_is_late():
    from lightning_islands.link.lanes import rendezvous_keys
    from lightning_islands.link.protocol import LateForRound

    coordinator = Coordinator()
    links = [_link(coordinator, i, 2, "sweep") for i in range(2)]
    run_threads([link.open_lanes for link in links])
    sweeper = links[0].membership.sweeper
    start_lanes = rendezvous_keys("sweep/lanes/", 2, 2)
    assert coordinator.store.check(start_lanes), "the lanes opened at the start left their rendezvous keys"

    def rounds(first: int, last: int) -> None:
        for r in range(first, last):
            run_threads([lambda link=link, r=r: (link.meet_round(r, {}), link.settle_round()) for link in links])
        deadline = time.monotonic() + 60
        while sweeper.swept < last - 3 and time.monotonic() < deadline:  # island 0 sweeps, in the background
            time.sleep(0.01)
        assert sweeper.swept == last - 3

    rounds(0, 4)
    assert not any(coordinator.store.check([key]) for key in start_lanes), "round 0 swept, its lanes' keys went too"
    after_4 = coordinator.store.num_keys()
    rounds(4, 24)
    assert coordinator.store.num_keys() <= after_4, "twenty more rounds left no more keys"
    assert not coordinator.store.check(["sweep/round21/a0/members"])
    assert coordinator.store.check(["sweep/round22/a0/members", "sweep/round23/a0/members"])
    late = Membership(coordinator.store, "sweep", 1, 2, 1, GRACE, 30.0, lambda i: None)
    with pytest.raises(LateForRound, match="round 3 is long over for the other islands"):
        late.decide(3, {})
    for link in links:
        link.close()


def test_the_sweep_of_a_round_deletes_the_rendezvous_keys_of_the_lanes_it_built():
    """A round whose member set changed built lanes under its own key: sweeping the round deletes
    their rendezvous keys, its leaders' and its other ranks' (sliced); lanes kept from an earlier
    round are not that round's to delete."""
    from lightning_islands.link.lanes import rendezvous_keys
    from lightning_islands.link.sweeper import round_keys

    store = Coordinator().store
    store.set("k/round5/a0/members", Decision(5, 0, (0, 2), "round4/a1").to_json())  # kept lanes
    store.set("k/round5/a1/members", Decision(5, 1, (0,), "round5/a1").to_json())  # one island: no lanes
    store.set("k/round6/a0/members", Decision(6, 0, (0, 1, 2), "round6/a0").to_json())
    assert not any("lane" in key for key in round_keys(store, "k", 5, 3, 2))
    keys = round_keys(store, "k", 6, 3, 2)
    assert set(rendezvous_keys("k/round6/a0/", 2, 3)) <= set(keys)
    assert "k/round6/a0/lane1//0/2" in keys and "k/round6/a0/members" in keys
    # exchange=sliced: ranks 1 and 2 of every island built lanes of their own for the round, rank 3 none
    ranks = [rendezvous_keys(f"k/round6/a0/rank{k}/", 2, 3) for k in (1, 2, 3)]
    for key in ranks[0] + ranks[1][-1:]:  # rank 2's only partly: its last member's key is there
        store.set(key, "address")
    keys = round_keys(store, "k", 6, 3, 2)
    assert set(ranks[0]) | set(ranks[1]) <= set(keys) and not set(ranks[2]) & set(keys)


def test_an_enrolment_counted_but_never_written_does_not_hide_the_ones_after_it():
    """A joiner that died between counting its enrolment and writing it leaves a gap in the log:
    later joiners are still taken into the roster, and the gap is read again each round."""
    coordinator = Coordinator()
    m0 = Membership(coordinator.store, "gap", 0, 2, 1, GRACE, None, lambda i: None)
    coordinator.store.add("gap/enrolled", 1)  # counted, never written
    Membership(coordinator.store, "gap", 3, 4, 1, GRACE, None, lambda i: None, joining=True).enroll()
    m0.read_enrolments()
    assert m0.roster == {0, 1, 3}
    coordinator.store.set("gap/enrol/1", json.dumps({"island": 2, "inc": 0}))  # written late after all
    m0.read_enrolments()
    assert m0.roster == {0, 1, 2, 3}
