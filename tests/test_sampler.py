"""IslandSampler: disjoint shares per (island, rank) that cover the dataset, for islands of equal and
of different sizes, deterministic in seed and epoch; one island samples as DistributedSampler does."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from lightning_islands.data import IslandSampler, shard_range
from lightning_islands.data.sampler import island_bounds


def shares(n, sizes, weights=None, **kwargs):
    """``{(island, rank): indices}`` for islands of ``sizes[i]`` ranks over ``n`` samples."""
    return {(i, r): IslandSampler(n, island=i, num_islands=len(sizes), rank=r, world_size=w, weights=weights,
                                  **kwargs).indices()
            for i, w in enumerate(sizes) for r in range(w)}


def island_parts(n, sizes, weights=None):
    bounds = island_bounds(n, len(sizes), weights)
    return [bounds[i + 1] - bounds[i] for i in range(len(sizes))]


@pytest.mark.parametrize(("n", "sizes", "weights"), [
    (12, [2, 1], None), (12, [2, 1], [2, 1]), (13, [2, 1], None), (13, [2, 1], [2, 1]),
    (100, [4, 1, 3], None), (100, [4, 1, 3], [4, 1, 3]), (7, [1, 1], None), (64, [8], None),
    (10, [3, 2], [0.5, 0.25]),
])
def test_drop_last_shares_are_disjoint_equal_per_island_and_cover_all_but_a_remainder(n, sizes, weights):
    got = shares(n, sizes, weights)
    everything = [x for ids in got.values() for x in ids]
    assert len(everything) == len(set(everything))  # disjoint, across islands and ranks
    assert set(everything) <= set(range(n))
    for i, (w, part) in enumerate(zip(sizes, island_parts(n, sizes, weights))):
        lengths = {len(got[i, r]) for r in range(w)}
        assert lengths == {part // w}  # every rank of an island takes the same number of steps
    assert n - len(everything) < sum(sizes)  # at most world_size - 1 dropped per island


@pytest.mark.parametrize(("n", "sizes", "weights"),
                         [(13, [2, 1], None), (100, [4, 1, 3], [4, 1, 3]), (9, [2, 4], None)])
def test_padded_shares_cover_everything_and_repeat_only_inside_an_island(n, sizes, weights):
    got = shares(n, sizes, weights, drop_last=False)
    assert set().union(*map(set, got.values())) == set(range(n))
    per_island = [{x for r in range(w) for x in got[i, r]} for i, w in enumerate(sizes)]
    for a in range(len(sizes)):
        for b in range(a + 1, len(sizes)):
            assert not per_island[a] & per_island[b]
    for i, w in enumerate(sizes):
        assert len({len(got[i, r]) for r in range(w)}) == 1


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4), weighted=st.booleans(),
       seed=st.integers(0, 2**31), epoch=st.integers(0, 5), shuffle=st.booleans(), drop_last=st.booleans())
def test_mixed_sizes_any_split_is_disjoint_and_covers(n, sizes, weighted, seed, epoch, shuffle, drop_last):
    weights = sizes if weighted else None
    parts = island_parts(n, sizes, weights)
    if any(p < w if drop_last else p == 0 for p, w in zip(parts, sizes)):  # refused, never silently empty
        with pytest.raises(ValueError, match="too few"):
            shares(n, sizes, weights, drop_last=drop_last)
        return
    got = {}
    for i, w in enumerate(sizes):
        for r in range(w):
            s = IslandSampler(n, island=i, num_islands=len(sizes), rank=r, world_size=w, weights=weights,
                              seed=seed, shuffle=shuffle, drop_last=drop_last)
            s.set_epoch(epoch)
            got[i, r] = s.indices()
            assert len(got[i, r]) == len(s) == (parts[i] // w if drop_last else -(-parts[i] // w))
    islands = [{x for r in range(w) for x in got[i, r]} for i, w in enumerate(sizes)]
    assert sum(map(len, islands)) == len(set().union(*islands))  # no sample on two islands
    if drop_last:  # and none on two ranks; all but each island's remainder
        counts = Counter(x for ids in got.values() for x in ids)
        assert set(counts.values()) <= {1}
        assert len(counts) == sum(p - p % w for p, w in zip(parts, sizes))
    else:  # every sample, repeats only to even out an island's ranks
        assert set().union(*islands) == set(range(n))


def test_equal_split_agrees_with_the_corpus_island_rule():
    for n, k in [(13, 2), (100, 3), (5, 5)]:
        assert [island_bounds(n, k)[i:i + 2] for i in range(k)] == [list(shard_range(n, i, k, 0, 1)) for i in range(k)]


def test_weights_follow_the_island_sizes():
    assert island_parts(12, [2, 1], [2, 1]) == [8, 4]
    assert island_parts(12, [2, 1]) == [6, 6]
    assert island_bounds(10, 3, [0.1, 0.2, 0.7]) == [0, 1, 3, 10]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_island_samples_as_distributed_sampler(drop_last, world):
    for rank in range(world):
        ours = IslandSampler(17, island=0, num_islands=1, rank=rank, world_size=world, seed=5, drop_last=drop_last)
        theirs = DistributedSampler(range(17), num_replicas=world, rank=rank, seed=5, drop_last=drop_last)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


def test_deterministic_in_seed_and_epoch():
    def draw(seed, epoch):
        s = IslandSampler(50, island=1, num_islands=2, rank=0, world_size=2, seed=seed)
        s.set_epoch(epoch)
        return list(s)

    assert draw(3, 1) == draw(3, 1)
    assert draw(3, 1) != draw(3, 2)
    assert draw(3, 1) != draw(4, 1)
    unshuffled = IslandSampler(10, island=1, num_islands=2, rank=1, world_size=2, shuffle=False)
    assert list(unshuffled) == [6, 8]


def test_identity_defaults_from_the_environment(monkeypatch):
    monkeypatch.delenv("LI_ISLAND", raising=False)
    monkeypatch.delenv("LI_NUM_ISLANDS", raising=False)
    alone = IslandSampler(range(8))
    assert (alone.island, alone.num_islands, alone.rank, alone.world_size) == (0, 1, 0, 1)
    assert sorted(alone) == list(range(8))
    monkeypatch.setenv("LI_ISLAND", "1")
    monkeypatch.setenv("LI_NUM_ISLANDS", "2")
    second = IslandSampler(8)
    assert (second.island, second.num_islands) == (1, 2)
    assert IslandSampler(8, island=0).island == 0  # arguments win
    monkeypatch.setenv("LI_ISLAND", "2")
    with pytest.raises(ValueError, match="outside"):
        IslandSampler(8)


def test_for_trainer_reads_the_strategy():
    strategy = SimpleNamespace(island_index=1, num_islands=3, distributed_sampler_kwargs={"rank": 1, "num_replicas": 2})
    s = IslandSampler.for_trainer(30, SimpleNamespace(strategy=strategy), seed=7)
    assert (s.island, s.num_islands, s.rank, s.world_size, s.seed) == (1, 3, 1, 2, 7)
    assert IslandSampler.for_trainer(30, SimpleNamespace(strategy=strategy), rank=0).rank == 0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"weights": [1]}, "one per island"), ({"weights": [1, 0]}, "positive"), ({"rank": 2, "world_size": 2}, "outside"),
    ({"island": 0, "num_islands": 1, "world_size": 4, "rank": 0, "n": 3}, "too few"),
])
def test_bad_arguments_are_named(kwargs, match):
    kwargs = {"island": 0, "num_islands": 2, "rank": 0, "world_size": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        IslandSampler(kwargs.pop("n", 10), **kwargs)
