"""The butterfly schedule and its mix (engine/butterfly.py): pure tests, property tests."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lightning_islands.engine.butterfly import Butterfly, mix


def _cycle(fly: Butterfly, states: dict, weights: dict, absent_from: dict | None = None) -> tuple[dict, dict, list]:
    """One cycle of stages; ``absent_from[i] = k``: island i takes no part from stage k on. Returns
    the states, the weights and, per stage, the groups (as sets of islands) that mixed."""
    absent_from = absent_from or {}
    seen = []
    for k in range(fly.stages):
        here = {i for i in states if absent_from.get(i, fly.stages) > k}
        new_states, new_weights, groups = dict(states), dict(weights), set()
        for i in sorted(here):
            group = fly.group(i, k)
            state, weight = mix({j: states[j] for j in here}, weights, group, first=k == 0)
            new_states[i], new_weights[i] = state, weight
            groups.add(frozenset(j for unit in group for j in unit if j in here))
        states, weights = new_states, new_weights
        seen.append(groups)
    return states, weights, seen


@pytest.mark.parametrize("n", range(1, 9))
def test_every_island_hears_from_every_other_within_log2_n_stages(n):
    fly = Butterfly(n)
    assert fly.stages == int(math.log2(n)) and fly.stages <= math.log2(n)
    knows = {i: {i} for i in range(n)}
    for k in range(fly.stages):
        knows = {i: set().union(*(knows[j] for unit in fly.group(i, k) for j in unit)) for i in range(n)}
        for i in range(n):  # the group is the same seen from each of its islands
            assert all(fly.group(j, k) == fly.group(i, k) for unit in fly.group(i, k) for j in unit)
            if n & (n - 1) == 0:  # a power of two: one partner, one payload per stage
                assert fly.peers(i, k) == (i ^ (1 << k),)
            else:
                assert 1 <= len(fly.peers(i, k)) <= 3
    assert all(knows[i] == set(range(n)) for i in range(n)), knows


def test_the_rule_for_counts_that_are_not_a_power_of_two():
    assert [Butterfly(n).units for n in range(1, 9)] == [1, 2, 2, 4, 4, 4, 4, 8]
    three, six = Butterfly(3), Butterfly(6)
    assert three.stages == 1 and three.group(2, 0) == ((0, 2), (1,)) and three.peers(1, 0) == (0, 2)
    assert six.group(5, 0) == ((0, 4), (1, 5)) and six.group(5, 1) == ((1, 5), (3,))
    assert six.unit_of(5) == 1 and six.islands_of(3) == (3,)
    with pytest.raises(ValueError, match="stage 2 is not one of the 2 stages of 6 islands"):
        six.group(0, 2)
    with pytest.raises(ValueError, match="island 6 is not one of 0..5"):
        six.unit_of(6)


def test_stages_advance_with_each_fragments_own_round_count():
    """With F fragments round r syncs fragment r % F for the (r // F)-th time: each fragment goes
    through every stage in turn, so every fragment meets every partner."""
    fly, fragments = Butterfly(8), 4
    stages = {f: [fly.stage_of(r // fragments) for r in range(f, 24, fragments)] for f in range(fragments)}
    assert all(s == [0, 1, 2, 0, 1, 2] for s in stages.values())
    assert Butterfly(1).stage_of(5) == 0


@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("seed", range(3))
def test_each_stage_keeps_the_token_weighted_mean_and_a_cycle_gives_it_to_every_island_bit_for_bit(n, seed):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    fly = Butterfly(n)
    states = {i: torch.randn(1000, generator=gen) * (1 + i) for i in range(n)}
    tokens = {i: float(rng.randint(1, 5000)) for i in range(n)}
    exact = sum(tokens[i] * states[i].double() for i in range(n)) / math.fsum(tokens.values())
    weights = dict(tokens)
    for k in range(fly.stages):
        states, weights, groups = _cycle_stage(fly, states, weights, k)
        for group in groups:  # the islands of a group leave bit-identical, with the group's weight
            first = min(group)
            assert all(torch.equal(states[i], states[first]) and weights[i] == weights[first] for i in group)
        # the token-weighted mean (by each island's own tokens) is kept, to float32's rounding
        kept = sum(tokens[i] * states[i].double() for i in range(n)) / math.fsum(tokens.values())
        torch.testing.assert_close(kept, exact, rtol=0, atol=1e-5 * float(exact.abs().max()))
    assert all(torch.equal(states[i], states[0]) for i in range(n)), "a cycle ends with one state everywhere"
    torch.testing.assert_close(states[0].double(), exact, rtol=0, atol=1e-5 * float(exact.abs().max()))
    assert all(weights[i] == math.fsum(tokens.values()) for i in range(n))


def _cycle_stage(fly: Butterfly, states: dict, weights: dict, k: int) -> tuple[dict, dict, set]:
    out_states, out_weights, groups = {}, {}, set()
    for i in states:
        group = fly.group(i, k)
        out_states[i], out_weights[i] = mix(states, weights, group, first=k == 0)
        groups.add(frozenset(j for unit in group for j in unit))
    return out_states, out_weights, groups


def test_a_stage_whose_partner_is_absent_is_the_identity():
    fly = Butterfly(4)
    states = {i: torch.full((3,), float(i)) for i in range(4)}
    tokens = {i: 1.0 for i in range(4)}
    # island 2 is lost from stage 1 on: island 0's partner at stage 1 is gone, island 0 keeps its pair's mean
    states_after, weights, seen = _cycle(fly, states, tokens, absent_from={2: 1})
    assert seen[0] == {frozenset({0, 1}), frozenset({2, 3})} and seen[1] == {frozenset({0}), frozenset({1, 3})}
    assert torch.equal(states_after[0], torch.full((3,), 0.5)) and weights[0] == 2.0
    assert torch.equal(states_after[1], states_after[3]) and weights[1] == 4.0
    with pytest.raises(ValueError, match="no island of the group"):
        mix({}, {}, fly.group(0, 0), first=True)
