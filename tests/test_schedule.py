"""The round schedule (sync warm-up, fixed steps per island) and the settings' checks, without any process."""

from __future__ import annotations

import pytest

from lightning_islands.engine import IslandSettings, RoundHeader, Schedule
from lightning_islands.strategy import IslandStrategy


def _schedule(**kwargs) -> Schedule:
    return Schedule(IslandSettings(**kwargs), island=0)


def test_sync_warmup_gives_each_round_its_h_then_sync_every():
    s = _schedule(sync_every=8, sync_warmup=[2, 4])
    assert [s.round_sync_every(r) for r in range(5)] == [2, 4, 8, 8, 8]
    assert s.steps_per_round == 2, "the first round already follows the warm-up"
    assert [s.planned_steps(r) for r in range(4)] == [2, 4, 8, 8]


def test_a_fixed_steps_per_round_island_scales_with_the_warmup():
    s = _schedule(sync_every=8, sync_warmup=[2, 4], steps_per_round=4)
    assert [s.planned_steps(r) for r in range(4)] == [1, 2, 4, 4]
    tiny = _schedule(sync_every=8, sync_warmup=[1], steps_per_round=2)
    assert tiny.planned_steps(0) == 1, "never zero steps"


def test_a_hydra_list_is_accepted():
    from omegaconf import OmegaConf

    s = IslandStrategy(sync_every=8, sync_warmup=OmegaConf.create([2, 4]), num_islands=1)
    assert s.settings.sync_warmup == [2, 4]


def test_the_island_process_group_outlasts_the_longest_round_wait():
    s = IslandStrategy(sync_every=8, num_islands=1, deadline_s=7200)
    assert s._timeout.total_seconds() >= 7800
    with pytest.raises(ValueError, match="deadline_s must be > 0"):
        IslandStrategy(sync_every=8, num_islands=1, deadline_s=0)


def test_no_warmup_keeps_sync_every():
    s = _schedule(sync_every=5)
    assert s.steps_per_round == 5 and s.round_sync_every(0) == s.round_sync_every(100) == 5


def test_a_round_is_due_after_its_steps_and_max_rounds_ends_the_last():
    s = _schedule(sync_every=3, max_rounds=2)
    assert [s.close_step() for _ in range(3)] == [False, False, True]
    s.advance(tokens=12, headers=[RoundHeader(0, step_seconds=0.1)])
    assert (s.round, s.round_steps, s.total_tokens) == (1, 0, 12)
    assert s.in_last_round() and not s.next_step_ends_last_round()
    s.close_step()
    s.close_step()
    assert s.next_step_ends_last_round()
    restored = _schedule(sync_every=3, max_rounds=2)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


@pytest.mark.parametrize("warmup", [[0], [3, -1], 10, "10,20", [2.5], [True]])
def test_bad_warmup_is_refused_with_the_cause(warmup):
    with pytest.raises(ValueError, match=r"sync_warmup must be a list of H values .* e.g. \[10, 20, 40\]"):
        IslandStrategy(sync_every=5, sync_warmup=warmup, num_islands=1)


@pytest.mark.parametrize("kwargs, needle", [
    ({"sync_every": 0}, r"sync_every \(H\) must be >= 1"),
    ({"weighting": "mean"}, "weighting must be 'tokens' or 'equal'"),
    ({"balance": "speed"}, "balance must be 'none' or 'time'"),
    ({"max_rounds": 0}, "max_rounds must be >= 1 or None"),
    ({"lanes": 0}, "lanes must be >= 1"),
    ({"outer_momentum": 0.0, "outer_momentum_warmup": 3}, "momentum_warmup ramps the outer momentum"),
    ({"exchange_chunk_mib": -1}, "the exchange chunk must be a positive size"),
])
def test_bad_settings_are_refused_by_name(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        IslandSettings(**kwargs)


def test_time_balance_ignores_the_clocks_of_absent_and_joining_islands():
    s = _schedule(sync_every=8, balance="time", max_rounds=10)
    fast, slow = RoundHeader(0, step_seconds=0.1), RoundHeader(0, step_seconds=0.2)
    assert s.next_round_steps([fast, slow]) == 16
    # a joiner's clock ran while it waited to get back in: it sets no budget
    assert s.next_round_steps([fast, RoundHeader(0, step_seconds=60.0, joining=True)]) == 8
    assert s.next_round_steps([fast, RoundHeader(0, step_seconds=0.0, absent=True)]) == 8
    assert _schedule(sync_every=8, balance="time", max_rounds=10).next_round_steps(
        [RoundHeader(0, step_seconds=60.0, joining=True), slow]) == 8, "a joiner runs its planned steps"


def test_the_seconds_to_the_round_are_the_steps_left_at_the_rounds_pace():
    """What an island's status reports (``eta_s``), read by the others' wait for slow islands."""
    s = _schedule(sync_every=4)
    assert s.seconds_to_round(0.0) is None, "no step timed yet"
    s.restart_clock()
    start = s._round_started
    s.close_step()
    s.close_step()
    assert s.seconds_to_round(start + 1.0) == pytest.approx(2 * 0.5)  # 2 steps in 1 s, 2 left
    s.exclude(0.5)  # a validation run is not step time
    assert s.seconds_to_round(start + 1.5) == pytest.approx(2 * 0.5)
    s.stopping = True
    assert s.seconds_to_round(start + 2.0) is None
