"""RoundDriver: when a training loop's rounds land and start, without Lightning and without a process.

Most tests drive a double of the engine that records what it is asked (its schedule is the real
one); the last drives a real one-island engine.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from test_engine import INNER_LR, SPECS, initial_flat, target

from lightning_islands.engine import CanonicalLayout, IslandEngine, IslandSettings, RoundDriver, Schedule


class FakeEngine:
    """What a :class:`RoundDriver` uses of :class:`IslandEngine`, with the real schedule. Every call
    is recorded as ``(what, inner steps, ...)``; a round in flight lands whenever asked, and takes
    ``land_seconds``; it stops the islands when ``stops`` is set."""

    def __init__(self, land_seconds: float = 0.0, **kw: Any) -> None:
        self.settings = IslandSettings(**{"sync_every": 4, **kw})
        self.schedule = Schedule(self.settings, 0)
        self.in_flight: int | None = None  # the inner steps when the round in flight started
        self.calls: list[tuple] = []
        self.land_seconds = land_seconds
        self.stops = False  # whether the round in flight was some island's last
        self.excluded: list[float] = []
        exclude = self.schedule.exclude
        self.schedule.exclude = lambda s: (self.excluded.append(s), exclude(s))[1]  # type: ignore[method-assign]

    def landing_due(self) -> bool:
        return self.in_flight is not None and self.schedule.inner_steps - self.in_flight >= self.settings.overlap_steps

    def start(self, locals_: Any, experts: Any, stop: bool, started: float, background: bool) -> None:
        if self.in_flight is not None:
            raise RuntimeError("a round is still in flight")
        assert background and not stop
        self.calls.append(("start", self.schedule.inner_steps))
        self.in_flight = self.schedule.inner_steps
        self.schedule.round_steps = 0

    def land(self, locals_: Any) -> tuple[dict[str, float], bool]:
        assert self.in_flight is not None, "the driver lands only a round in flight"
        time.sleep(self.land_seconds)
        steps_since, self.in_flight = self.schedule.inner_steps - self.in_flight, None
        self.calls.append(("land", self.schedule.inner_steps))
        self.schedule.advance(0, [], steps_since)
        self.schedule.stopping = self.schedule.stopping or self.stops
        return {"islands/round": float(self.schedule.round)}, self.stops

    def run_round(self, locals_: Any, experts: Any, stop: bool, started: float) -> tuple[dict[str, float], bool]:
        if self.in_flight is not None:
            raise RuntimeError("a round is still in flight")
        self.calls.append(("run", self.schedule.inner_steps, stop))
        self.schedule.stopping = self.schedule.stopping or stop
        self.schedule.advance(0, [])
        return {"islands/round": float(self.schedule.round)}, stop


def _driver(engine: FakeEngine, **kw: Any) -> tuple[RoundDriver, dict[str, list]]:
    seen: dict[str, list] = {"locals": [], "experts": [], "rounds": []}

    def locals_() -> list[torch.Tensor]:
        seen["locals"].append(engine.schedule.inner_steps)
        return []

    def experts() -> None:
        seen["experts"].append(engine.schedule.inner_steps)

    driver = RoundDriver(engine, locals_, experts=experts,  # type: ignore[arg-type]
                         on_round=lambda m, stop: seen["rounds"].append((m["islands/round"], stop)), **kw)
    return driver, seen


def test_an_overlapped_round_lands_overlap_steps_later_and_one_flies_at_a_time():
    engine = FakeEngine(sync_every=4, overlap_steps=3)
    driver, seen = _driver(engine)
    for _ in range(12):
        driver.step_closed()
        assert engine.in_flight is None or engine.schedule.inner_steps - engine.in_flight <= 3
    assert engine.calls == [("start", 4), ("land", 7), ("start", 8), ("land", 11), ("start", 12)]
    assert seen["rounds"] == [(1.0, False), (2.0, False)]
    driver.run_round()  # a round run by hand (Lightning's outer_step) lands the one in flight first
    assert engine.calls[-2:] == [("land", 12), ("start", 12)]


def test_the_last_round_is_synchronous_and_stops():
    engine = FakeEngine(sync_every=2, overlap_steps=1, max_rounds=3)
    driver, seen = _driver(engine)  # the default last round: max_rounds
    for _ in range(6):
        driver.step_closed()
    assert engine.calls == [("start", 2), ("land", 3), ("start", 4), ("land", 5), ("run", 6, True)]
    assert seen["rounds"][-1] == (3.0, True) and engine.schedule.stopping
    asked = FakeEngine(sync_every=2, overlap_steps=1)
    driver, _ = _driver(asked, last=lambda: asked.schedule.inner_steps >= 4)  # the caller's rule
    for _ in range(4):
        driver.step_closed()
    assert asked.calls == [("start", 2), ("land", 3), ("run", 4, True)]


def test_without_overlap_every_round_is_synchronous_and_restarts_the_clock():
    engine = FakeEngine(sync_every=2)
    driver, seen = _driver(engine)
    restarts = []
    restart = engine.schedule.restart_clock
    engine.schedule.restart_clock = lambda **kw: (restarts.append(engine.schedule.inner_steps),  # type: ignore
                                                  restart(**kw))[1]
    for _ in range(4):
        driver.step_closed()
    assert engine.calls == [("run", 2, False), ("run", 4, False)]
    assert restarts == [2, 4] and seen["rounds"] == [(1.0, False), (2.0, False)]


@pytest.mark.parametrize("steps, calls, global_end", [
    (5, [("start", 4), ("land", 5), ("run", 5, True)], False),  # a round in flight lands, then the last one
    (3, [("run", 3, True)], False),  # a partial last round
], ids=["in flight", "partial"])
def test_the_end_lands_then_runs_the_last_round(steps, calls, global_end):
    engine = FakeEngine(sync_every=4, overlap_steps=2)
    driver, seen = _driver(engine)
    for _ in range(steps):
        driver.step_closed()
    assert driver.end() is global_end
    assert engine.calls == calls and engine.in_flight is None
    assert seen["rounds"][-1][1] is True


def test_the_end_after_the_islands_agreed_to_stop_runs_no_round():
    engine = FakeEngine(sync_every=4, overlap_steps=2)
    driver, seen = _driver(engine)
    for _ in range(5):
        driver.step_closed()
    assert engine.calls == [("start", 4)]
    engine.stops = True  # the round in flight was another island's last
    assert driver.end() is True, "the caller ends on the global parameters"
    assert engine.calls == [("start", 4), ("land", 5)] and engine.in_flight is None
    assert seen["rounds"] == [(1.0, True)]


def test_landing_and_its_callback_are_left_out_of_the_step_time():
    engine = FakeEngine(land_seconds=0.05, sync_every=2, overlap_steps=1)
    driver = RoundDriver(engine, lambda: [], on_round=lambda m, stop: time.sleep(0.03))  # type: ignore[arg-type]
    for _ in range(3):
        driver.step_closed()
    assert len(engine.excluded) == 1 and engine.excluded[0] >= 0.08
    assert engine.schedule._untimed_seconds >= 0.08
    driver.land()  # nothing in flight: nothing excluded
    assert len(engine.excluded) == 1


def test_locals_and_expert_counts_are_fetched_only_when_a_round_needs_them():
    engine = FakeEngine(sync_every=4, overlap_steps=2)
    driver, seen = _driver(engine)
    for _ in range(3):
        driver.step_closed()
    driver.land()
    assert seen == {"locals": [], "experts": [], "rounds": []}
    driver.step_closed()  # round due: started
    assert seen["locals"] == [4] and seen["experts"] == [4]
    driver.step_closed()  # in flight, not due to land yet
    driver.step_closed()  # lands: locals, no expert counts
    assert seen["locals"] == [4, 6] and seen["experts"] == [4]


def test_a_real_island_driven_to_its_end():
    """One island of the real engine: rounds fly and land, the end runs the last one; the anchors
    are the locals after it."""
    settings = IslandSettings(sync_every=4, outer_lr=0.7, outer_momentum=0.9, overlap_steps=1, overlap_alpha=0.5)
    layout = CanonicalLayout(SPECS)
    engine = IslandEngine(settings, layout, 0, 1, torch.device("cpu"), torch.device("cpu"))
    locals_ = [layout.shard_of(initial_flat(0), i).clone() for i in range(len(SPECS))]
    engine.adopt_initial_state(locals_, {})
    fetched, rounds = [], []
    driver = RoundDriver(engine, lambda: fetched.append(engine.schedule.inner_steps) or locals_,
                         on_round=lambda m, stop: rounds.append((m.get("islands/round"), stop)))
    for _ in range(10):
        goal = target(0, engine.schedule.inner_steps)
        for i, loc in enumerate(locals_):
            loc.sub_(torch.mul(torch.sub(loc, layout.shard_of(goal, i)), INNER_LR))
        engine.count_tokens(1)
        driver.step_closed()
    assert fetched == [4, 5, 8, 9] and engine.in_flight is None
    assert rounds == [(1.0, False), (2.0, False)]
    assert driver.end() is False
    assert rounds[-1] == (3.0, True) and engine.schedule.stopping and fetched[-1] == 10
    assert all(torch.equal(a, loc) for a, loc in zip(engine.state.anchors, locals_))
