"""Bounded staleness (``max_staleness``): a late island's work is merged into a later round.

Islands are threads (the engine harness of test_engine); :class:`LateLink` is the in-memory link
double with one change: in the rounds it is told, one island arrives after the round was decided
without it (:class:`LateForRound`, as the real membership raises it) and is taken into the next
round when it asks (``rejoin``). The merge is checked against DiLoCo in float64 with the late
island's pseudo-gradient, taken from its old anchors, weighted by its tokens times the decay.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from doubles import Hub, MemoryLink, MemoryRankLink, ThreadGroup, ThreadIsland, run_threads
from test_engine import INNER_LR, SPECS, initial_flat, target

from lightning_islands.engine import CanonicalLayout, IslandEngine, IslandSettings
from lightning_islands.link.auth import AuthenticatedLink
from lightning_islands.link.protocol import LateForRound

H, TOKENS = 3, [4, 6, 5, 3]


class LateLink(MemoryLink):
    """A :class:`MemoryLink` whose island ``late[r]`` misses round ``r`` (the others decide it alone)."""

    def __init__(self, hub: Hub, island: int, late: dict[int, int]) -> None:
        super().__init__(hub, island)
        self.late, self.round = late, -1

    def meet_round(self, round_: int, header: dict) -> list[dict | None]:
        self.round, self._calls = round_, 0
        missing = self.late.get(round_)
        if missing == self.island:
            self.lanes_key = None  # as the real link's: an island taken back builds the lanes anew
            raise LateForRound(f"round {round_} was decided without island {self.island}")
        present = tuple(i for i in range(self.num_islands) if i != missing)
        if present != self.present or self.lanes_key is None:  # new lanes for a new member set, a key never reused
            self.lanes_key = f"round{round_}"
        self.present = present
        posts = self.hub.meet(f"round{round_}", self.island, header, needed=self.present)
        return [posts.get(i) if i in self.present else None for i in range(self.num_islands)]

    def rejoin(self, timeout_s: float, from_round: int = 0, every: int = 1) -> int:
        nearest = max(self.round + 1, from_round)  # the next round it may join (the others' next decision)
        return nearest + (from_round - nearest) % every

    def _next(self, kind: str) -> str:
        return f"r{self.round}/{super()._next(kind)}"

    def all_gather_bytes(self, payload: torch.Tensor, limit: int | None = None) -> list[torch.Tensor]:
        posts = self.hub.meet(self._next("gather"), self.island, payload.detach().cpu().clone(), needed=self.present)
        self.stats.bytes_received += sum(t.numel() for i, t in posts.items() if i != self.island)
        return [posts.get(i, torch.empty(0, dtype=torch.uint8)) for i in range(self.num_islands)]

    def broadcast_bytes(self, payload: torch.Tensor | None, src: int = 0, limit: int | None = None) -> torch.Tensor:
        value = payload.detach().cpu().clone() if self.island == src else None
        return self.hub.meet(self._next("broadcast"), self.island, value, needed=[src])[src]


def _island(i: int, n: int, rounds: int, late: dict[int, int], settings: dict[str, Any], hub: Hub,
            secret: bytes | None = None, group: ThreadGroup | None = None) -> dict[str, Any]:
    """One rank of island ``i`` (``group``: its island's ranks; default one): rank 0 holds the
    island's :class:`LateLink`, every other rank its own in-memory lanes (``exchange=sliced``)."""
    s = IslandSettings(**{"sync_every": H, "outer_lr": 0.7, "outer_momentum": 0.9, "codec": "fp32",
                          "max_staleness": 2, "staleness_decay": 0.5, **settings})
    group = group or ThreadGroup(ThreadIsland(1), 0)
    layout = CanonicalLayout(SPECS, group)
    engine = IslandEngine(s, layout, i, n, torch.device("cpu"), torch.device("cpu"))
    locals_ = [layout.shard_of(initial_flat(0), k).clone() for k in range(len(SPECS))]

    def open_link() -> Any:
        link = LateLink(hub, i, late)
        return AuthenticatedLink(link, secret, "late") if secret else link

    engine.meet(open_link, s.fingerprint(layout, False, "cpu"),
                open_rank_link=lambda: MemoryRankLink(hub, i, group.rank))
    engine.adopt_initial_state(locals_, {})
    out: dict[str, Any] = {"rounds": {}, "metrics": {}}
    while engine.schedule.round < rounds and not engine.schedule.stopping:
        for _ in range(engine.schedule.steps_per_round - engine.schedule.round_steps):
            goal = target(i, engine.schedule.inner_steps)
            for k, loc in enumerate(locals_):
                loc.sub_(torch.mul(torch.sub(loc, layout.shard_of(goal, k)), INNER_LR))
            engine.count_tokens(TOKENS[i])
            engine.schedule.close_step()
        metrics, _ = engine.run_round(locals_)
        r = engine.schedule.round - 1
        flat = engine.global_flat()  # on the island's rank 0
        out["rounds"][r], out["metrics"][r] = None if flat is None else flat.clone(), metrics
    return out


def run(rounds: int, late: dict[int, int], settings: dict[str, Any] | None = None, n: int = 3,
        secret: bytes | None = None, sizes: list[int] | None = None) -> list[dict[str, Any]]:
    """Island leaders' results; ``sizes``: each island's ranks (threads; default one each)."""
    hub, sizes = Hub(n), sizes or [1] * n
    shared = [ThreadIsland(size) for size in sizes]
    jobs = [lambda i=i, r=r: _island(i, n, rounds, late, settings or {}, hub, secret, ThreadGroup(shared[i], r))
            for i in range(n) for r in range(sizes[i])]
    results = run_threads(jobs)
    return [results[sum(sizes[:i])] for i in range(n)]


def reference(rounds: int, late: dict[int, int], max_staleness: int = 2, decay: float = 0.5) -> list[torch.Tensor]:
    """The global state after each round in float64: a late island trains its H steps from the global
    state it had, misses the round (and waits, without steps, through the rounds it is late for
    again), and its pseudo-gradient joins the merge of the round that takes it in with weight
    tokens * decay^age (dropped past ``max_staleness``)."""
    glob, buf, out = initial_flat(0).double(), None, []
    steps = [0, 0, 0]
    anchor: dict[int, tuple[torch.Tensor, int]] = {}  # a late island's anchors and outer step count
    for r in range(rounds):
        deltas, weights = [], []
        for i in range(3):
            if late.get(r) == i:  # trains its steps, arrives after the decision (late again: it waits)
                if i in anchor:
                    continue
                local = glob.clone()
                for _ in range(H):
                    local = local - INNER_LR * (local - target(i, steps[i]).double())
                    steps[i] += 1
                anchor[i] = (glob, r, local)  # type: ignore[assignment]
                continue
            if i in anchor:  # caught up: no more steps, its pseudo-gradient from its old anchors
                old, when, local = anchor.pop(i)  # type: ignore[misc]
                age = r - when
                if age <= max_staleness:
                    deltas.append(old - local)
                    weights.append(TOKENS[i] * H * decay ** age)
                continue
            local = glob.clone()
            for _ in range(H):
                local = local - INNER_LR * (local - target(i, steps[i]).double())
                steps[i] += 1
            deltas.append(glob - local)
            weights.append(TOKENS[i] * H)
        merged = sum(w / sum(weights) * d for w, d in zip(weights, deltas))
        buf = merged.clone() if buf is None else 0.9 * buf + merged
        glob = glob - 0.7 * (merged + 0.9 * buf)
        out.append(glob.float())
    return out


def test_a_late_islands_pseudo_gradient_is_merged_a_round_later_with_its_decayed_weight():
    late = {1: 2}  # island 2 misses round 1; round 2 merges its work from round 1's anchors (age 1)
    islands = run(4, late)
    want = reference(4, late)
    for r in range(4):
        for i in range(3):
            if late.get(r) == i:
                assert r not in islands[i]["rounds"], "a late island takes no outer step of its own"
                continue
            torch.testing.assert_close(islands[i]["rounds"][r], want[r], rtol=1e-5, atol=1e-5)
            assert torch.equal(islands[i]["rounds"][r], islands[0]["rounds"][r]), f"round {r}, island {i}"
    assert islands[2]["metrics"][2]["islands/staleness"] == 1.0
    assert islands[0]["metrics"][2]["islands/stale_merged"] == 1.0
    assert islands[0]["metrics"][2]["islands/islands_repaired"] == 1.0, "the late island adopts the new state"
    assert [islands[0]["metrics"][r]["islands/staleness"] for r in range(4)] == [0.0] * 4


def test_a_contribution_older_than_max_staleness_is_dropped_and_its_island_adopts():
    late = {1: 2, 2: 2, 3: 2}  # island 2 is late three rounds running: its work from round 1 is 3 rounds old
    # when it is taken in (round 4), so it is dropped
    islands = run(5, late)
    want = reference(5, late)
    for r in range(5):
        torch.testing.assert_close(islands[0]["rounds"][r], want[r], rtol=1e-5, atol=1e-5)
    assert sorted(islands[2]["rounds"]) == [0, 4]
    for r in (0, 4):
        assert torch.equal(islands[2]["rounds"][r], islands[0]["rounds"][r])
    assert islands[2]["metrics"][4]["islands/staleness"] == -1.0  # 3 > max_staleness=2: not merged
    assert islands[0]["metrics"][4]["islands/stale_merged"] == 0.0


@pytest.mark.parametrize("bad, needle", [({"max_staleness": -1}, "max_staleness"),
                                         ({"staleness_decay": 0.0}, "staleness_decay"),
                                         ({"staleness_wait_s": -1.0}, "staleness_wait_s"),
                                         ({"max_staleness": 1, "overlap_steps": 1, "topology": "butterfly"},
                                          "topology=allreduce")])
def test_bad_staleness_settings_are_refused_naming_them(bad, needle):
    with pytest.raises(ValueError, match=needle):
        IslandSettings(**bad)


def test_with_the_butterfly_a_late_island_misses_its_stage_and_mixes_its_work_at_the_next():
    """Four butterfly islands; island 1 misses round 1 (stage 1, partner island 3, which mixes alone)
    and joins round 2 (stage 0, partner island 0) with its work since round 0: the pair mixes it with
    its weight halved (age 1) and ends bit-identical, and island 1's step count catches up."""
    bfly = {"topology": "butterfly", "codec": "int4", "error_feedback": True}
    late, on_time = run(4, {1: 1}, bfly, n=4), run(4, {}, bfly, n=4)
    assert 1 not in late[1]["rounds"]
    assert late[3]["metrics"][1]["islands/group_size"] == 1.0 and late[3]["metrics"][1]["islands/mixed"] == 1.0
    m0, m1 = late[0]["metrics"][2], late[1]["metrics"][2]
    assert m1["islands/staleness"] == 1.0 and m0["islands/stale_merged"] == 1.0 and m0["islands/mixed"] == 2.0
    assert torch.equal(late[0]["rounds"][2], late[1]["rounds"][2])
    assert not torch.equal(late[0]["rounds"][2], on_time[0]["rounds"][2])
    assert torch.equal(late[2]["rounds"][0], on_time[2]["rounds"][0])
    # round 3 (stage 1 again): islands 1 and 3 meet with their bases in agreement, no repair
    assert late[1]["metrics"][3]["islands/islands_repaired"] == 0.0 and late[1]["metrics"][3]["islands/mixed"] == 2.0
    assert torch.equal(late[1]["rounds"][3], late[3]["rounds"][3])


def test_max_tokens_stops_every_island_after_the_round_that_reaches_the_runs_budget():
    from test_engine import Plan, leaders
    from test_engine import run as run_plan

    # a round of 3 steps merges 4*3 (island 0) + 2*4*3 (island 1, two ranks) = 36 tokens, 12 a step:
    # 80 is reached in round 3, which runs the one step that the 8 tokens left need (not 3: 108)
    results = leaders(run_plan(Plan(sizes=[1, 2], tokens=[4, 4], rounds=10, settings={"max_tokens": 80})))
    for island in results:
        assert len(island["rounds"]) == 3
        assert [m["islands/run_tokens"] for m in island["metrics"]] == [36.0, 72.0, 84.0]
        assert [m["islands/steps_per_round"] for m in island["metrics"]][:2] == [3.0, 1.0]  # the next round's
        assert island["schedule"]["stopping"] is True
    with pytest.raises(ValueError, match="max_tokens"):
        IslandSettings(max_tokens=100, fragments=2, sync_every=4)


def test_with_a_secret_an_island_mixing_alone_keeps_its_payload_sequence_in_step():
    """Island 1 misses rounds 1-3 (one member set, one sequence of payload numbers): island 3 mixes
    alone at stage 1, island 0 at stage 0, and the next stage pairs islands 2 and 3 under MACs that
    bind each payload's call number, which holds only if a lone island counts its swaps too."""
    bfly = {"topology": "butterfly", "codec": "int4", "error_feedback": True}
    islands = run(5, {1: 1, 2: 1, 3: 1}, bfly, n=4, secret=b"s" * 32)
    assert [islands[3]["metrics"][r]["islands/group_size"] for r in (1, 2, 3)] == [1.0, 2.0, 1.0]
    assert torch.equal(islands[2]["rounds"][2], islands[3]["rounds"][2])
    assert torch.equal(islands[0]["rounds"][3], islands[2]["rounds"][3])


def test_a_late_island_counts_the_runs_tokens_from_the_others_and_stops_with_them():
    """Rounds merge 45 tokens (30 in round 1, which island 2 misses): 45, 75, 120, then the 30 that
    a budget of 150 has left (2 of the 3 steps). The budget ends the run after round 3 on every
    island, the late one included, whose own count missed round 1 (it takes the largest count in
    the round's headers)."""
    islands = run(8, {1: 2}, {"max_tokens": 150})
    for i, island in enumerate(islands):
        assert max(island["rounds"]) == 3, (i, sorted(island["rounds"]))
        assert island["metrics"][3]["islands/run_tokens"] == 150.0


def test_the_start_agreement_lets_an_island_behind_hold_an_older_state_and_keeps_island_numbers():
    from lightning_islands.engine.rendezvous import agree_on_start

    class Side:
        def __init__(self, found: list[dict[str, Any]]) -> None:
            self.found = found

        def with_link(self, work: Any) -> Any:
            return work(self)

        def gather_objects(self, key: str, obj: object) -> list:
            return self.found

    behind = {"digest": "old", "round": 3, "more": False, "steps": 2}
    ahead = {"digest": "new", "round": 4, "more": True, "steps": 3}
    assert agree_on_start(Side([behind, ahead, ahead]), "new", 4, True, 3, max_staleness=1) == [0]  # type: ignore
    with pytest.raises(RuntimeError, match="different global states"):
        agree_on_start(Side([behind, ahead, ahead]), "new", 4, True, 3, max_staleness=0)  # type: ignore
    with pytest.raises(RuntimeError, match="different global states"):
        agree_on_start(Side([{**behind, "steps": 1}, ahead]), "new", 4, True, 3, max_staleness=1)  # type: ignore


def test_with_fragments_a_late_island_merges_its_fragment_late_and_keeps_its_other_work():
    """Two fragments (a round syncs one, every H/F = 2 steps); island 2 misses round 2 (fragment 0).
    Round 3 (fragment 1) takes it in: its fragment 1 is the others', so it merges its work there as
    usual; round 4 (fragment 0) merges its fragment-0 work from round 2 late (age 1) and it adopts the
    others' fragment 0, keeping its progress in fragment 1. From then on every island holds the same
    global state, which differs from a run where nobody is late (the late work was merged, not lost)."""
    frag = {"fragments": 2, "sync_every": 4}
    late, on_time = run(6, {2: 2}, frag), run(6, {}, frag)
    assert 2 not in late[2]["rounds"]
    for r in (0, 1):
        assert torch.equal(late[0]["rounds"][r], on_time[0]["rounds"][r])
    m3, m4 = late[2]["metrics"][3], late[2]["metrics"][4]
    assert (m3["islands/staleness"], m3["islands/islands_repaired"]) == (0.0, 0.0), m3
    assert (m4["islands/staleness"], m4["islands/islands_repaired"]) == (1.0, 1.0), m4
    assert late[0]["metrics"][4]["islands/stale_merged"] == 1.0
    for r in (4, 5):
        for i in (1, 2):
            assert torch.equal(late[i]["rounds"][r], late[0]["rounds"][r]), f"round {r}, island {i}"
    assert not torch.equal(late[0]["rounds"][5], on_time[0]["rounds"][5])
    assert torch.isfinite(late[0]["rounds"][5]).all()


def test_a_repair_moves_the_other_fragments_local_parameters_with_their_anchors():
    from lightning_islands.engine.health import rebase

    old = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    new = [torch.tensor([5.0, 5.0]), torch.tensor([0.0])]
    locals_ = [torch.tensor([1.5, 1.0]), torch.tensor([3.25])]
    rebase(locals_, old, new, skip={1})
    assert torch.equal(locals_[0], torch.tensor([5.5, 4.0])) and torch.equal(locals_[1], torch.tensor([3.25]))


@pytest.mark.parametrize("settings", [{"codec": "int4", "error_feedback": True},
                                      {"codec": "fp32", "fragments": 2, "sync_every": 4}])
def test_sliced_islands_merge_late_work_as_the_leaders_do_bit_for_bit(settings):
    """Islands of 3, 3 and 2 ranks; island 2 misses round 1 (with two fragments, round 2): with
    ``exchange=sliced`` every rank moves its slice of the late work a round later, and every island's
    global state after every round equals the leader path's, bit for bit."""
    # with two fragments the late fragment-0 work waits for round 4, fragment 0's next
    late, stale_round = ({1: 2}, 2) if "fragments" not in settings else ({2: 2}, 4)
    sizes = [3, 3, 2]  # the late island is the smallest: its absence changes the slices
    leader = run(5, late, settings, sizes=sizes)
    got = run(5, late, {**settings, "exchange": "sliced"}, sizes=sizes)
    assert got[2]["metrics"][stale_round]["islands/staleness"] == 1.0
    assert got[0]["metrics"][stale_round]["islands/stale_merged"] == 1.0
    assert got[0]["metrics"][stale_round]["islands/exchange_chunks"] == 2.0, "two slices: the smaller islands' ranks"
    for i in range(3):
        assert sorted(got[i]["rounds"]) == sorted(leader[i]["rounds"])
        for r, state in leader[i]["rounds"].items():
            assert torch.equal(got[i]["rounds"][r], state), f"island {i}, round {r}"
        for r in range(stale_round, 5):  # from the round that takes its work in, one global state
            assert torch.equal(got[i]["rounds"][r], got[0]["rounds"][r]), f"island {i}, round {r}"


@pytest.mark.parametrize("exchange", ["leader", "sliced"])
def test_an_overlapped_round_landed_at_once_catches_a_late_island_up_as_the_synchronous_one(exchange):
    """``max_staleness`` with rounds in the background: the island late for round 1 is caught up in
    the round's thread (taken into round 2 with its work pending), and landed at once that gives the
    synchronous path's ``_catch_up`` bit for bit: the same late merge, repair and states."""
    from test_streaming import run as run_streaming

    sizes, kw = [2, 1, 3], {"max_staleness": 2, "codec": "int4", "error_feedback": True, "exchange": exchange}
    sync = run_streaming(sizes, kw, 16, late={1: 2})
    background = run_streaming(sizes, kw, 16, late={1: 2}, mode="land_at_once")
    assert [m["islands/staleness"] for m in background[2]["metrics"]] == [0.0, 1.0, 0.0]
    assert [m["islands/stale_merged"] for m in background[0]["metrics"]] == [0.0, 0.0, 1.0, 0.0]
    for a, b in zip(sync, background):
        assert len(a["globals"]) == len(b["globals"])
        assert all(torch.equal(x, y) for x, y in zip(a["globals"], b["globals"]))
        assert all(torch.equal(x, y) for x, y in zip(a["locals"], b["locals"]))


@pytest.mark.parametrize("kw, late", [
    ({"codec": "int4"}, {1: 2}),
    ({"codec": "fp8", "error_feedback": True, "overlap_alpha": 0.0}, {1: 2}),
    ({"codec": "int4", "fragments": 2}, {1: 2, 2: 2}),
], ids=["int4", "fp8+ef", "fragments"])
def test_an_island_late_for_an_overlapped_round_merges_its_work_late_while_it_trains(kw, late):
    """``max_staleness`` with ``overlap_steps``: island 2 misses overlapped round 1; its thread joins
    round 2 (with two fragments round 3, the next of its snapshot's fragment: it misses round 2 too)
    with its work of round 1, merged with its weight decayed (age 1), while its ranks train; every
    island that takes part in a round holds the same state after it, and the sliced exchange gives
    the leader path's bits."""
    from test_streaming import run as run_streaming

    sizes, kw = [2, 1, 3], {"max_staleness": 2, "overlap_steps": 1, "overlap_alpha": 0.5, **kw}
    got = run_streaming(sizes, kw, 16, late=late)
    ages = {int(m["islands/round"]) - 1: m["islands/staleness"] for m in got[2]["metrics"]}  # by round
    joined = max(late) + 1
    assert ages[joined] == 1.0 and max(ages.values()) == 1.0 and not set(late) & set(ages), ages
    merged = {int(m["islands/round"]) - 1: m["islands/stale_merged"] for m in got[0]["metrics"]}
    assert [r for r, n in merged.items() if n] == [joined], merged
    rounds = {i: dict(zip([int(m["islands/round"]) for m in island["metrics"]], island["globals"]))
              for i, island in enumerate(got)}
    for r, state in rounds[0].items():
        for i in (1, 2):
            if r in rounds[i]:
                assert torch.equal(rounds[i][r], state), (r, i)
    assert len(rounds[2]) < len(rounds[0])
    sliced = run_streaming(sizes, {**kw, "exchange": "sliced"}, 16, late=late)
    for a, b in zip(got, sliced):
        assert all(torch.equal(x, y) for x, y in zip(a["globals"], b["globals"]))
        assert all(torch.equal(x, y) for x, y in zip(a["locals"], b["locals"]))
