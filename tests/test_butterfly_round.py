"""The butterfly topology in the round: islands and ranks as threads (the engine harness of test_engine).

The invariant the butterfly keeps instead of "identical everywhere after every round"
(lightning_islands.engine.mixing): the islands of a stage's group leave it bit-identical, every
stage mixes the group's proposals with their token weights (checked against DiLoCo's outer step
per island and the weighted mix in float64), each island receives only its partners' payloads, and
an island whose base differs from its partner's takes the partner's state and ends the stage equal.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from doubles import ThreadGroup, ThreadIsland
from test_engine import INNER_LR, SPECS, Plan, initial_flat, leaders, run, target

from lightning_islands.engine import CanonicalLayout, IslandSettings
from lightning_islands.engine.butterfly import Butterfly
from lightning_islands.engine.fragments import split_fragments

BUTTERFLY = {"topology": "butterfly"}


def butterfly_reference(plan: Plan) -> tuple[list[list[torch.Tensor]], list[float], list[float]]:
    """Each island's global state after each round, in float64: its own outer step (Nesterov, its own
    momentum) on its own pseudo-gradient, then the weighted mix of its group's proposals; and island
    0's spread each round (the largest distance from its proposal to a partner's, over its global
    model's norm before the round), and the largest distance between two islands' global models
    before each round over the same norm."""
    s = {"sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9, **plan.settings}
    n, h, mu, lr = len(plan.sizes), s["sync_every"], s["outer_momentum"], s["outer_lr"]
    bf = Butterfly(n)
    glob = [initial_flat(0).double() for _ in range(n)]
    bufs: list[torch.Tensor | None] = [None] * n
    out, spreads, apart, step = [], [], [], 0
    for r in range(plan.rounds):
        props, weights = [], []
        for i in range(n):
            local = glob[i].clone()
            for k in range(h):
                local = local - INNER_LR * (local - target(i, step + k).double())
            delta = glob[i] - local
            bufs[i] = delta.clone() if bufs[i] is None else mu * bufs[i] + delta
            props.append(glob[i] - lr * (delta + mu * bufs[i]))
            weights.append(plan.sizes[i] * plan.tokens[i] * h)
        stage = bf.stage_of(r)
        apart.append(max(float((a - b).norm()) for a in glob for b in glob) / float(glob[0].norm()))
        spreads.append(max(float((props[j] - props[0]).norm()) for j in bf.peers(0, stage)) / float(glob[0].norm()))
        for i in range(n):
            group = sorted(j for unit in bf.group(i, stage) for j in unit)
            glob[i] = sum(weights[j] * props[j] for j in group) / sum(weights[j] for j in group)
            if plan.experts is not None and s.get("expert_weighting"):  # each expert's rows by its tokens
                counts = torch.tensor([plan.experts[j] for j in group], dtype=torch.float64)
                total = counts.sum(0)
                shares = torch.where(total > 0, counts / total.clamp_min(1e-300), 1.0 / len(group))
                e = CanonicalLayout(SPECS).entries[[name for name, _, _ in SPECS].index("experts")]
                rows = torch.stack([props[j][e.offset:e.offset + e.numel].view(e.shape) for j in group])
                glob[i][e.offset:e.offset + e.numel] = (shares[:, :, None] * rows).sum(0).reshape(-1)
        step += h
        out.append([g.float() for g in glob])
    return out, spreads, apart


def pairs(bf: Butterfly, stage: int) -> list[list[int]]:
    groups = {tuple(sorted(j for unit in bf.group(i, stage) for j in unit)) for i in range(bf.num_islands)}
    return [list(g) for g in sorted(groups)]


@pytest.mark.parametrize("sizes", [[1, 2, 1, 3], [2, 1, 3]])
def test_each_stage_leaves_its_group_identical_and_matches_the_float64_mix(sizes):
    plan = Plan(sizes=sizes, tokens=[8, 3, 5, 2][: len(sizes)], rounds=4, settings=BUTTERFLY)
    results = leaders(run(plan))
    bf = Butterfly(len(sizes))
    want, spreads, apart = butterfly_reference(plan)
    for r in range(plan.rounds):
        for group in pairs(bf, bf.stage_of(r)):
            first = results[group[0]]["rounds"][r]
            for i in group[1:]:
                assert torch.equal(results[i]["rounds"][r], first), f"round {r}: islands {group} differ"
        for i in range(len(sizes)):
            torch.testing.assert_close(results[i]["rounds"][r], want[r][i], rtol=1e-5, atol=1e-5)
        m = results[0]["metrics"][r]
        assert m["islands/partner_spread"] == pytest.approx(spreads[r], rel=1e-4)
        # estimated from the headers' sketches: zero while the islands agree, then within the sketch's noise
        assert m["islands/spread"] == pytest.approx(apart[r], rel=0.3, abs=1e-6)
    if len(sizes) == 4:  # islands 0 and 3 never share a group: their states differ, the mix still pulls them
        assert not torch.equal(results[0]["rounds"][-1], results[3]["rounds"][-1])
        m = results[0]["metrics"][-1]
        assert m["islands/group_size"] == 2 and m["islands/butterfly_stage"] == 1
        # one payload in, one out: the partner's, not N - 1 of them
        assert m["islands/bytes_received"] == m["islands/payload_bytes"] == m["islands/bytes_sent"]


def test_with_expert_weighting_each_experts_rows_mix_by_the_tokens_the_group_routed_to_it():
    experts = [[10.0, 0.0, 5.0, 0.0], [30.0, 20.0, 5.0, 0.0], [0.0, 4.0, 1.0, 0.0], [2.0, 2.0, 2.0, 0.0]]
    plan = Plan(sizes=[1, 2, 1, 3], tokens=[8, 3, 5, 2], rounds=4, experts=experts,
                settings={**BUTTERFLY, "expert_weighting": True})
    results = leaders(run(plan))
    plain = leaders(run(dataclasses.replace(plan, settings=BUTTERFLY, experts=None)))
    want, _, _ = butterfly_reference(plan)
    bf = Butterfly(4)
    e = CanonicalLayout(SPECS).entries[[name for name, _, _ in SPECS].index("experts")]
    for r in range(plan.rounds):
        for group in pairs(bf, bf.stage_of(r)):
            assert all(torch.equal(results[i]["rounds"][r], results[group[0]]["rounds"][r]) for i in group)
        for i in range(4):
            torch.testing.assert_close(results[i]["rounds"][r], want[r][i], rtol=1e-5, atol=1e-5)
    rows = slice(e.offset, e.offset + e.numel)
    assert not torch.equal(results[0]["rounds"][0][rows], plain[0]["rounds"][0][rows])
    assert torch.equal(results[0]["rounds"][0][: e.offset], plain[0]["rounds"][0][: e.offset])


def test_quantized_butterfly_rounds_keep_groups_identical_across_shardings():
    plan = Plan(sizes=[2, 3, 1, 2], tokens=[4, 4, 4, 4], rounds=4,
                settings={**BUTTERFLY, "codec": "int4", "error_feedback": True})
    results = leaders(run(plan))
    bf = Butterfly(4)
    for r in range(plan.rounds):
        for group in pairs(bf, bf.stage_of(r)):
            assert all(torch.equal(results[i]["rounds"][r], results[group[0]]["rounds"][r]) for i in group)
    assert all(m["islands/residual_norm"] > 0 for m in results[1]["metrics"])


def fragment_positions(fragment: int, fragments: int) -> torch.Tensor:
    """The flat canonical positions of ``fragment``'s parameters."""
    layout = CanonicalLayout(SPECS)
    idx = split_fragments([e.name for e in layout.entries], [e.numel for e in layout.entries], fragments,
                          "sequential")[fragment]
    return torch.cat([torch.arange(layout.entries[i].offset, layout.entries[i].offset + layout.entries[i].numel)
                      for i in idx])


def test_with_fragments_the_stage_follows_each_fragments_own_rounds():
    plan = Plan(sizes=[1, 1, 1, 1], tokens=[4, 4, 4, 4], rounds=8,
                settings={**BUTTERFLY, "fragments": 2, "sync_every": 4, "fragment_layout": "sequential"})
    results = leaders(run(plan))
    bf = Butterfly(4)
    for r in range(plan.rounds):
        stage, pos = bf.stage_of(r // 2), fragment_positions(r % 2, 2)
        assert results[0]["metrics"][r]["islands/butterfly_stage"] == stage
        for group in pairs(bf, stage):
            for i in group:
                assert torch.equal(results[i]["rounds"][r][pos], results[group[0]]["rounds"][r][pos]), (r, group)
        other = [g for g in pairs(bf, stage) if 0 not in g][0][0]
        assert not torch.equal(results[0]["rounds"][r][pos], results[other]["rounds"][r][pos])


def test_an_island_whose_base_differs_takes_its_partners_state():
    plan = Plan(sizes=[1, 2, 1, 1], tokens=[4, 4, 4, 4], rounds=2, settings=BUTTERFLY)
    first = run(plan)
    saved = {key: copy.deepcopy(res) for key, res in first.items()}
    for rank in range(2):  # island 1 restarts from a damaged base of stage 0 (every rank's shards)
        saved[1, rank]["state"]["base0"] = [b + 1e-3 for b in saved[1, rank]["state"]["base0"]]
    plan.rounds = 3  # round 2 is stage 0 again: islands 0 and 1 meet
    everyone = run(plan, resume=saved)
    results = leaders(everyone)
    m0, m1 = results[0]["metrics"][-1], results[1]["metrics"][-1]
    assert m0["islands/islands_repaired"] == m1["islands/islands_repaired"] == 1
    assert m0["islands/mixed"] == 1 and m0["islands/group_size"] == 2
    assert torch.equal(results[0]["rounds"][-1], results[1]["rounds"][-1]), "the repaired island ends equal"
    assert results[2]["metrics"][-1]["islands/islands_repaired"] == 1, "the round's count, on every island"
    assert torch.equal(results[2]["rounds"][-1], results[3]["rounds"][-1])
    # island 1 took island 0's momentum from before the round (island 0's own step then moved its own)
    before = torch.cat([m.reshape(-1) for m in saved[0, 0]["state"]["momentum"]])
    for rank in range(2):
        layout = CanonicalLayout(SPECS, ThreadGroup(ThreadIsland(2), rank))
        got = everyone[1, rank]["state"]["momentum"]
        assert all(torch.equal(got[i], layout.shard_of(before, i)) for i in range(len(SPECS)))


def test_an_unknown_topology_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="topology"):
        IslandSettings(**{**BUTTERFLY, "topology": "ring"})


def test_four_islands_over_the_real_authenticated_link_give_the_in_memory_bits():
    """The butterfly's pairwise swaps over the coordinator and gloo lanes (threads of this process),
    every payload under a MAC that binds its sender and group: the same states as in memory."""
    from doubles import run_threads
    from test_engine import loopback_island

    from lightning_islands.link.auth import AuthenticatedLink
    from lightning_islands.link.coordinator import Coordinator
    from lightning_islands.link.island_link import IslandLink

    plan = Plan(sizes=[1, 1, 1, 1], tokens=[4, 6, 3, 5], rounds=3, same_seed=True,
                settings={**BUTTERFLY, "codec": "int4", "error_feedback": True})
    coordinator = Coordinator()
    links = [AuthenticatedLink(IslandLink(coordinator.address, i, 4, run_id="bfly", lanes=2), b"k" * 32, "bfly")
             for i in range(4)]

    over_tcp = run_threads([lambda i=i: loopback_island(i, lambda k: links[k], plan) for i in range(4)])
    for link in links:
        link.close()
    in_memory = [res["rounds"] for res in leaders(run(plan))]
    for i in range(4):
        assert all(torch.equal(a, b) for a, b in zip(over_tcp[i], in_memory[i])), f"island {i}"


def test_an_island_cannot_join_a_butterfly_run_under_way():
    from lightning_islands.engine import IslandEngine

    settings = IslandSettings(**BUTTERFLY)
    engine = IslandEngine(settings, CanonicalLayout(SPECS), 4, 5, torch.device("cpu"), torch.device("cpu"))
    with pytest.raises(ValueError, match="cannot join a run under way with topology=butterfly"):
        engine.meet(lambda: None, {}, joining=True)  # type: ignore[arg-type,return-value]


def test_a_nan_island_is_left_out_of_its_pair_and_adopts_its_partners_proposal():
    from test_streaming import run as run_steps

    steps = 12  # rounds end at steps 3, 7, 11 (H=4); island 1 breaks in the second round (stage 1: 1 with 3)
    islands = run_steps([1, 1, 1, 1], BUTTERFLY, steps, poison=(1, 5, float("nan")))
    assert [m["islands/islands_left_out"] for m in islands[3]["metrics"]] == [0.0, 1.0, 0.0]
    assert [m["islands/mixed"] for m in islands[1]["metrics"]] == [2.0, 1.0, 2.0]
    assert [m["islands/islands_left_out"] for m in islands[0]["metrics"]] == [0.0, 0.0, 0.0]
    assert torch.equal(islands[1]["globals"][1], islands[3]["globals"][1]), "the pair still ends the stage equal"
    assert all(torch.isfinite(g).all() for island in islands for g in island["globals"])
    assert all(torch.isfinite(t).all() for t in islands[1]["locals"])


def test_the_sketch_ignores_the_sharding_and_estimates_distances():
    from doubles import run_threads

    def sketch(flat: torch.Tensor, size: int) -> list[list[float]]:
        shared = ThreadIsland(size)

        def rank(r: int) -> list[float]:
            layout = CanonicalLayout(SPECS, ThreadGroup(shared, r))
            return layout.island_sketch([layout.shard_of(flat, i).clone() for i in range(len(SPECS))])

        return run_threads([lambda r=r: rank(r) for r in range(size)])

    a = initial_flat(1)
    one, three = sketch(a, 1), sketch(a, 3)
    assert all(torch.allclose(torch.tensor(s), torch.tensor(one[0]), rtol=0, atol=1e-9) for s in one + three)
    ratios = []
    for seed in range(8):
        b = a + torch.randn(a.numel(), generator=torch.Generator().manual_seed(seed)) * (0.1 + seed)
        estimate = (torch.tensor(sketch(b, 2)[0]) - torch.tensor(one[0])).norm()
        ratios.append(float(estimate / (b - a).double().norm()))
    assert all(0.75 < r < 1.25 for r in ratios), ratios


@pytest.mark.parametrize("sizes, settings", [
    ([2, 3, 2, 2], {"codec": "int4", "error_feedback": True}),
    ([3, 2, 4], {"codec": "fp8", "error_feedback": True, "fragments": 2, "sync_every": 4}),
    ([2, 2, 3, 2], {"expert_weighting": True})])
def test_sliced_butterfly_rounds_equal_the_leaders_bit_for_bit(sizes, settings):
    """``exchange=sliced``: each owner swaps its slice with its partners' owners of it; every island's
    state after every round, and its metrics, are the leader path's (islands of 2 to 4 ranks, a count
    of islands that is not a power of two, fragments, expert weighting)."""
    experts = [[10.0, 0.0, 5.0, 0.0], [30.0, 20.0, 5.0, 0.0], [0.0, 4.0, 1.0, 0.0], [2.0, 2.0, 2.0, 0.0]]
    plan = Plan(sizes=sizes, tokens=[8, 3, 5, 2][: len(sizes)], rounds=4, settings={**BUTTERFLY, **settings},
                experts=experts[: len(sizes)] if "expert_weighting" in settings else None)
    leader = leaders(run(plan))
    got = leaders(run(dataclasses.replace(plan, settings={**plan.settings, "exchange": "sliced"})))
    for i, (want, have) in enumerate(zip(leader, got)):
        for r in range(plan.rounds):
            assert torch.equal(have["rounds"][r], want["rounds"][r]), f"island {i}, round {r}"
            for key in ("islands/partner_spread", "islands/cosine"):
                assert have["metrics"][r][key] == pytest.approx(want["metrics"][r][key], rel=1e-4, abs=1e-9), key
            for key in ("islands/payload_bytes", "islands/bytes_received"):  # a header more per slice
                assert have["metrics"][r][key] == pytest.approx(want["metrics"][r][key], rel=0.02), key
            assert have["metrics"][r]["islands/exchange_chunks"] == 2.0, "two slices: the smallest island's ranks"


def test_a_sliced_butterfly_repairs_slice_by_slice_as_the_leader_would(monkeypatch):
    """``exchange=sliced``: the repaired island takes its partner's anchors, base and momentum rank to
    rank, slice by slice (no rank gathers them), and every island ends as the leader path leaves it."""
    from test_sliced import forbid_gather_inside

    from lightning_islands.engine import mix_repair

    def repaired(exchange: str) -> dict:
        plan = Plan(sizes=[2, 3, 2, 2], tokens=[4, 4, 4, 4], rounds=2,
                    settings={**BUTTERFLY, "exchange": exchange, "codec": "int4", "exchange_chunk_mib": 4096 / 2**20})
        saved = {key: copy.deepcopy(res) for key, res in run(plan).items()}
        for rank in range(3):  # island 1 restarts from a damaged base of stage 0 (every rank's shards)
            saved[1, rank]["state"]["base0"] = [b + 1e-3 for b in saved[1, rank]["state"]["base0"]]
        plan.rounds = 3  # round 2 is stage 0 again: islands 0 and 1 meet
        return run(plan, resume=saved)

    leader = repaired("leader")
    _, calls = forbid_gather_inside(monkeypatch, mix_repair, "repair", "the sliced butterfly repair")
    got = repaired("sliced")
    assert sorted({args[0].island for args, _ in calls}) == [0, 1, 2, 3]  # every island takes part (most with nobody)
    assert leaders(got)[1]["metrics"][-1]["islands/islands_repaired"] == 1
    for key, want in leader.items():
        if key[1] == 0:  # the global state after each round, on the leader
            assert all(torch.equal(a, b) for a, b in zip(want["rounds"], got[key]["rounds"])), key
        for name in ("anchor", "momentum", "base0", "base1"):
            assert all(torch.equal(a, b) for a, b in zip(want["state"][name], got[key]["state"][name])), (key, name)


def overlapped_reference(sizes: list[int], kw: dict, steps: int) -> list[list[torch.Tensor]]:
    """The butterfly with ``overlap_steps`` in float64 (test_streaming's run: 7 tokens per rank per
    step, one fragment): at each sync point every island takes its own Nesterov step on its own
    pseudo-gradient (its proposal); tau steps later each island's global model becomes its group's
    token-weighted mean of the proposals and its local parameters ``global + alpha (local - global)``.
    Each island's global model after each round."""
    from test_streaming import BASE

    s = {**BASE, "overlap_alpha": 0.0, **kw}
    n, h, mu, lr, tau, alpha = len(sizes), s["sync_every"], s["outer_momentum"], s["outer_lr"], s["overlap_steps"], \
        s["overlap_alpha"]
    bf = Butterfly(n)
    glob = [initial_flat(0).double() for _ in range(n)]
    local = [g.clone() for g in glob]
    bufs: list[torch.Tensor | None] = [None] * n
    out: list[list[torch.Tensor]] = [[] for _ in range(n)]
    flying, rounds = None, 0

    def land(stage: int, props: list[torch.Tensor], stepped: list[torch.Tensor]) -> None:
        for i in range(n):
            group = sorted(j for unit in bf.group(i, stage) for j in unit)
            glob[i] = sum(sizes[j] * props[j] for j in group) / sum(sizes[j] for j in group)
        for i in range(n):
            bufs[i] = stepped[i]
            local[i] = glob[i] + alpha * (local[i] - glob[i]) if tau else glob[i].clone()
            out[i].append(glob[i].clone())

    for step in range(1, steps + 1):
        for i in range(n):
            local[i] = local[i] - INNER_LR * (local[i] - target(i, step - 1).double())
        if flying is not None and step - flying[0] >= tau:
            land(*flying[1:])
            flying = None
        if step % h == 0:
            deltas = [glob[i] - local[i] for i in range(n)]
            stepped = [d.clone() if b is None else mu * b + d for b, d in zip(bufs, deltas)]
            props = [glob[i] - lr * (deltas[i] + mu * stepped[i]) for i in range(n)]
            fly = (step, bf.stage_of(rounds), props, stepped)
            rounds += 1
            if tau and step != steps:
                flying = fly
            else:
                land(*fly[1:])
    return out


OVERLAP = {**BUTTERFLY, "overlap_steps": 1, "overlap_alpha": 0.5}


def test_overlapped_butterfly_rounds_match_the_reference_and_pairs_agree():
    """``overlap_steps`` with the butterfly: the mix flies while the islands train; every island
    lands its group's mix of the proposals taken at the sync point (float64 reference), the
    islands of a group leave each stage bit-identical, and the sliced exchange gives the leader
    path's bits."""
    from test_streaming import run as run_streaming

    sizes, steps = [2, 1, 1, 3], 16
    got = run_streaming(sizes, OVERLAP, steps)
    expected = overlapped_reference(sizes, OVERLAP, steps)
    bf = Butterfly(4)
    for i, island in enumerate(got):
        assert len(island["globals"]) == len(expected[i]) == 4
        for r, (a, ref) in enumerate(zip(island["globals"], expected[i])):
            torch.testing.assert_close(a.double(), ref, rtol=1e-5, atol=1e-5, msg=f"island {i}, round {r + 1}")
        assert "islands/seconds_waiting_in_flight" in island["metrics"][0]
    for r in range(4):
        for group in pairs(bf, bf.stage_of(r)):
            assert all(torch.equal(got[i]["globals"][r], got[group[0]]["globals"][r]) for i in group), (r, group)
    sliced = run_streaming(sizes, {**OVERLAP, "exchange": "sliced", "codec": "int4", "error_feedback": True}, steps)
    leader = run_streaming(sizes, {**OVERLAP, "codec": "int4", "error_feedback": True}, steps)
    for a, b in zip(leader, sliced):
        assert all(torch.equal(x, y) for x, y in zip(a["globals"], b["globals"]))
        assert all(torch.equal(x, y) for x, y in zip(a["locals"], b["locals"]))


def test_the_butterflys_background_path_landed_at_once_is_its_synchronous_round():
    from test_streaming import run as run_streaming

    sizes, steps, kw = [2, 1, 1, 1], 12, {**BUTTERFLY, "codec": "int4", "exchange_chunk_mib": 0.004}
    sync = run_streaming(sizes, kw, steps)
    background = run_streaming(sizes, kw, steps, mode="land_at_once")
    for a, b in zip(sync, background):
        assert len(a["globals"]) == len(b["globals"]) == 3
        assert all(torch.equal(x, y) for x, y in zip(a["globals"], b["globals"]))
        assert all(torch.equal(x, y) for x, y in zip(a["locals"], b["locals"]))


@pytest.mark.parametrize("exchange", ["leader", "sliced"])
def test_an_overlapped_butterfly_repairs_a_damaged_base_when_the_round_lands(exchange):
    """Island 1's base of stage 0 loses a bit after round 1: at round 3 (stage 0 again) its partner
    island 0 is its group's source, the repair runs when the round lands (the island's collectives
    are the training's until then), and the pair ends the round equal; sliced as the leader path."""
    from test_streaming import run as run_streaming

    sizes, steps, kw = [2, 3, 1, 2], 16, {**OVERLAP, "exchange": exchange}
    got = run_streaming(sizes, kw, steps, corrupt_base=(1, 1))
    repaired = [m["islands/islands_repaired"] for m in got[1]["metrics"]]
    assert repaired == [0.0, 0.0, 1.0, 0.0], repaired
    assert got[0]["metrics"][2]["islands/mixed"] == 1  # the repaired island is left out of the mix
    assert torch.equal(got[0]["globals"][2], got[1]["globals"][2])
    if exchange == "sliced":
        leader = run_streaming(sizes, {**kw, "exchange": "leader"}, steps, corrupt_base=(1, 1))
        for a, b in zip(leader, got):
            assert all(torch.equal(x, y) for x, y in zip(a["globals"], b["globals"]))


def test_a_repair_keeps_the_links_in_step_when_one_island_runs_the_round_synchronously():
    """Island 1 runs its rounds in the foreground (as a rejoiner's or a last round runs) while its
    partners fly theirs; its base of stage 0 is damaged after round 1, so round 3 repairs it: the
    repair comes after the mix and its settling in both kinds of round, so the islands' calls on
    the link meet, and the pair ends the round equal."""
    from test_streaming import run as run_streaming

    got = run_streaming([2, 1, 1, 2], OVERLAP, 16, corrupt_base=(1, 1), mode={1: "synchronous"})
    assert [m["islands/islands_repaired"] for m in got[0]["metrics"]] == [0.0, 0.0, 1.0, 0.0]
    assert "islands/seconds_waiting_in_flight" in got[0]["metrics"][0]
    assert "islands/seconds_waiting_in_flight" not in got[1]["metrics"][0]
    assert torch.equal(got[0]["globals"][2], got[1]["globals"][2])


@pytest.mark.parametrize("exchange", ["leader", "sliced"])
def test_a_lost_repair_leaves_the_island_out_of_its_round_and_the_next_stage_repairs_it(exchange, monkeypatch):
    """The repair of island 1's damaged base is lost at round 3 (every island's transfer raises
    RoundLost, as a dropped peer makes it): the others land their mixes, island 1 lands none (its base
    is not its group's) and skips the round, and round 5, stage 0 again, repairs it."""
    from test_streaming import run as run_streaming

    from lightning_islands.engine import mix_repair
    from lightning_islands.link.protocol import RoundLost

    name = "_through_slices" if exchange == "sliced" else "_through_leader"
    real, lost = getattr(mix_repair, name), set()

    def losing(engine, mix, headers, repairs, *args):
        if headers[0].round == 2:  # round 3: every island's transfer of the repair is lost
            lost.add(engine.island)
            raise RoundLost(f"island {engine.island} lost the repair (injected)")
        return real(engine, mix, headers, repairs, *args)

    monkeypatch.setattr(mix_repair, name, losing)
    got = run_streaming([2, 1, 1, 2], {**OVERLAP, "exchange": exchange}, 24, corrupt_base=(1, 1))
    assert lost == {0, 1, 2, 3}
    rounds = [[int(m["islands/round"]) for m in island["metrics"]] for island in got]
    assert rounds[0] == [1, 2, 3, 4, 5, 6] and rounds[1] == [1, 2, 4, 5, 6], rounds  # island 1 skipped round 3
    assert [m["islands/islands_repaired"] for m in got[0]["metrics"]] == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert torch.equal(got[0]["globals"][4], got[1]["globals"][3])  # round 5: the pair equal again
