"""The round schedule of IslandStrategy (sync warm-up, fixed steps per island) without any process."""

from __future__ import annotations

import pytest

from lightning_islands.strategy import IslandStrategy


def test_sync_warmup_gives_each_round_its_h_then_sync_every():
    s = IslandStrategy(sync_every=8, sync_warmup=[2, 4], num_islands=1)
    assert [s.round_sync_every(r) for r in range(5)] == [2, 4, 8, 8, 8]
    assert s.steps_per_round == 2, "the first round already follows the warm-up"
    assert [s._planned_steps(r) for r in range(4)] == [2, 4, 8, 8]


def test_a_fixed_steps_per_round_island_scales_with_the_warmup():
    s = IslandStrategy(sync_every=8, sync_warmup=[2, 4], steps_per_round=4, num_islands=1)
    assert [s._planned_steps(r) for r in range(4)] == [1, 2, 4, 4]
    tiny = IslandStrategy(sync_every=8, sync_warmup=[1], steps_per_round=2, num_islands=1)
    assert tiny._planned_steps(0) == 1, "never zero steps"


def test_a_hydra_list_is_accepted():
    from omegaconf import OmegaConf

    s = IslandStrategy(sync_every=8, sync_warmup=OmegaConf.create([2, 4]), num_islands=1)
    assert s.sync_warmup == [2, 4]


def test_the_island_process_group_outlasts_the_longest_round_wait():
    s = IslandStrategy(sync_every=8, num_islands=1, timeout_s=600, max_wait_s=7200)
    assert s._timeout.total_seconds() >= 7800
    with pytest.raises(ValueError, match="max_wait_s must be > 0"):
        IslandStrategy(sync_every=8, num_islands=1, max_wait_s=0)


def test_no_warmup_keeps_sync_every():
    s = IslandStrategy(sync_every=5, num_islands=1)
    assert s.steps_per_round == 5 and s.round_sync_every(0) == s.round_sync_every(100) == 5


@pytest.mark.parametrize("warmup", [[0], [3, -1], 10, "10,20", [2.5], [True]])
def test_bad_warmup_is_refused_with_the_cause(warmup):
    with pytest.raises(ValueError, match=r"sync_warmup must be a list of H values .* e.g. \[10, 20, 40\]"):
        IslandStrategy(sync_every=5, sync_warmup=warmup, num_islands=1)
