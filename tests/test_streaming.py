"""Streaming DiLoCo in the engine: fragments that take turns, and rounds that fly while inner steps run.

Islands and their ranks are threads (as in ``test_engine``); the link is the in-memory double. The
streaming run is checked against a float64 reference of the algorithm, against the synchronous
path bit for bit where they must agree, and across islands that shard differently.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest
import torch
from doubles import Hub, MemoryLink, MemoryRankLink, ThreadGroup, ThreadIsland, run_threads
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import INNER_LR, SPECS, initial_flat, target

from lightning_islands.engine import CanonicalLayout, IslandEngine, IslandSettings, RoundDriver, RoundHeader
from lightning_islands.engine.fragments import block_key, split_fragments
from lightning_islands.models.moe import MoELanguageModel

BASE = {"sync_every": 4, "outer_lr": 0.7, "outer_momentum": 0.9, "codec": "fp32"}


class GatedLink(MemoryLink):
    """A link whose round headers wait until ``gate`` opens: the background exchange of an overlapped
    round can only run after the inner steps taken meanwhile have written the parameters."""

    def __init__(self, hub: Hub, island: int, gate: threading.Event) -> None:
        super().__init__(hub, island)
        self.gate = gate

    def gather_objects(self, key: str, obj: object) -> list:
        if key.startswith("round"):
            assert self.gate.wait(60), "the test never opened the gate"
        return super().gather_objects(key, obj)


class RecordingLink(MemoryLink):
    """A link that keeps the round headers this island sent, and the bytes each swap received."""

    def __init__(self, hub: Hub, island: int) -> None:
        super().__init__(hub, island)
        self.sent: list[dict] = []
        self.swapped: list[int] = []

    def swap_bytes(self, payload: torch.Tensor, peers: Any, limit: int | None = None) -> dict[int, torch.Tensor]:
        got = super().swap_bytes(payload, peers, limit)
        self.swapped.append(payload.numel() + sum(t.numel() for t in got.values()))
        return got

    def gather_objects(self, key: str, obj: object) -> list:
        if key.startswith("round"):
            self.sent.append(obj)  # type: ignore[arg-type]
        return super().gather_objects(key, obj)


def _island_main(sizes: list[int], kw: dict[str, Any], steps: int, island: int, group: ThreadGroup, hub: Hub,
                 mode: str | dict[int, str] = "auto", gates: list[threading.Event] | None = None,
                 experts: bool = False, poison: tuple[int, int, float] | None = None,
                 corrupt: tuple[int, int] | None = None, late: dict[int, int] | None = None,
                 corrupt_base: tuple[int, int] | None = None) -> dict[str, Any]:
    """Train ``steps`` inner steps and run the rounds the schedule asks for; a round due at the last
    step is synchronous and ends the run. ``mode``: ``auto`` (a :class:`RoundDriver`: the settings decide, overlap when
    ``overlap_steps`` > 0), ``land_at_once`` (the background path, landed right after it starts),
    ``synchronous`` (every round in the foreground, whatever the settings); a dict: each island's.
    ``late``: island ``late[r]`` misses round ``r`` (test_staleness's LateLink)."""
    mode = mode.get(island, "auto") if isinstance(mode, dict) else mode
    settings = IslandSettings(**{**BASE, **kw})
    layout = CanonicalLayout(SPECS, group)
    engine = IslandEngine(settings, layout, island, len(sizes), torch.device("cpu"), torch.device("cpu"))
    start = initial_flat(island)
    locals_ = [layout.shard_of(start, i).clone() for i in range(len(SPECS))]
    gate = gates[island] if gates else None
    from test_staleness import LateLink

    engine.meet(lambda: LateLink(hub, island, late) if late else GatedLink(hub, island, gate) if gate else
                RecordingLink(hub, island),
                settings.fingerprint(layout, False, "cpu"),
                open_rank_link=lambda: MemoryRankLink(hub, island, group.rank))
    engine.adopt_initial_state(locals_, {})
    globals_, metrics = [], []

    def counts() -> dict[str, list[float]] | None:
        """This island's tokens per expert of the round (summed over its ranks): a fixed skew per island."""
        if not experts:
            return None
        mine = [float(1 + island * e + engine.schedule.round) if group.rank == 0 else 0.0 for e in range(4)]
        return {"experts": group.sum(mine)}

    def landed(m: dict[str, float], stop: bool) -> None:
        flat = engine.global_flat()
        if m:
            metrics.append(m)
            globals_.append(None if flat is None else flat.clone())
            if corrupt == (island, len(metrics)) and group.rank == 0:  # (island, round): one bit of its anchors flips
                first = engine.state.anchors[0].view(-1)[:1]
                first.view(torch.int32).bitwise_xor_(1)
            if corrupt_base == (island, len(metrics)) and group.rank == 0:  # the butterfly's base of stage 0
                engine.state.bases[0][0].view(-1)[:1].view(torch.int32).bitwise_xor_(1)

    driver = RoundDriver(engine, lambda: locals_, experts=counts, on_round=landed,
                         last=lambda: engine.schedule.inner_steps == steps)

    for step in range(steps):
        goal = target(island, engine.schedule.inner_steps)
        for i, loc in enumerate(locals_):
            loc.sub_(torch.mul(torch.sub(loc, layout.shard_of(goal, i)), INNER_LR))
        if poison is not None and poison[:2] == (island, step):  # (island, step, value): a broken inner step
            for i, loc in enumerate(locals_):
                anchor, value = engine.state.anchors[i], poison[2]
                loc.copy_(torch.full_like(loc, value) if math.isnan(value) else anchor + (loc - anchor) * value)
        engine.count_tokens(7)
        if gate is not None and engine.in_flight is not None:
            gate.set()  # an inner step has written the parameters since the round in flight started
        if mode == "auto":
            driver.step_closed()
        elif mode == "synchronous":
            if engine.schedule.close_step():
                landed(*engine.run_round(locals_, counts(), stop=step == steps - 1))
        elif engine.schedule.close_step():  # land_at_once: no round overlaps, so none is in flight here
            if step == steps - 1:
                landed(*engine.run_round(locals_, counts(), stop=True))
            else:
                engine.start(locals_, counts(), background=True)
                landed(*engine.land(locals_))
    return {"globals": globals_, "metrics": metrics, "digest": engine.global_state_digest(),
            "headers": getattr(engine.link, "sent", []), "swapped": getattr(engine.link, "swapped", []),
            "residual": engine.state.residual,
            "locals": [t.clone() for t in locals_], "leader": group.rank == 0}


def run(sizes: list[int], kw: dict[str, Any], steps: int, **extra: Any) -> list[dict[str, Any]]:
    """Every rank of every island as a thread; the leaders' results in island order."""
    hub = Hub(len(sizes))
    jobs = []
    for island, size in enumerate(sizes):
        shared = ThreadIsland(size)
        for rank in range(size):
            group = ThreadGroup(shared, rank)
            jobs.append(lambda i=island, g=group: _island_main(sizes, kw, steps, i, g, hub, **extra))
    results = run_threads(jobs)
    return [r for r in results if r["leader"]]


def reference(sizes: list[int], kw: dict[str, Any], steps: int) -> list[torch.Tensor]:
    """Streaming DiLoCo in float64 on full vectors: fragment f (of the engine's split) syncs every H
    steps at offset (f + 1) H / F; its pseudo-gradients are snapshots at the sync point; tau steps
    later the token-weighted merge takes an outer Nesterov step on the fragment (its own momentum),
    and each island's fragment becomes ``global + alpha (local - global)``. Global state after each
    round."""
    s = {**BASE, "fragments": 1, "overlap_steps": 0, "overlap_alpha": 0.0, **kw}
    frags = split_fragments([n for n, _, _ in SPECS], [torch.Size(sh).numel() for _, sh, _ in SPECS],
                            s["fragments"], s.get("fragment_layout", "strided"))
    offsets = [0]
    for _, shape, _ in SPECS:
        offsets.append(offsets[-1] + torch.Size(shape).numel())
    masks = [torch.cat([torch.full((offsets[i + 1] - offsets[i],), i in f) for i in range(len(SPECS))])
             for f in frags]
    glob = initial_flat(0).double()  # island 0's state is everyone's start
    local = [glob.clone() for _ in sizes]
    buf: list[torch.Tensor | None] = [None] * len(frags)
    weights = torch.tensor([float(n) for n in sizes], dtype=torch.float64)
    weights /= weights.sum()
    every, tau, out, flying = s["sync_every"] // s["fragments"], s["overlap_steps"], [], None
    for step in range(1, steps + 1):
        for i in range(len(sizes)):
            local[i] = local[i] - INNER_LR * (local[i] - target(i, step - 1).double())

        def land(fly: tuple) -> None:
            f, deltas = fly
            m = masks[f]
            g = sum(w * d for w, d in zip(weights, deltas))
            buf[f] = g.clone() if buf[f] is None else buf[f] * s["outer_momentum"] + g
            glob[m] = glob[m] - s["outer_lr"] * (g + s["outer_momentum"] * buf[f])[m]
            for i in range(len(sizes)):
                local[i][m] = glob[m] + s["overlap_alpha"] * (local[i][m] - glob[m]) if tau else glob[m]
            out.append(glob.clone())

        if flying is not None and step - flying[2] >= tau:
            land(flying[:2])
            flying = None
        if step % every == 0:
            f = (step // every - 1) % s["fragments"]
            fly = (f, [glob - loc for loc in local], step)
            if tau and step != steps:
                flying = fly
            else:
                land(fly[:2])
    return out


@pytest.mark.parametrize("layout", ["strided", "sequential"])
def test_the_fragments_cover_every_parameter_once_per_period(layout):
    model = MoELanguageModel(vocab_size=64, seq_len=16, d_model=16, n_layers=4, n_heads=2, n_experts=4, top_k=2,
                             d_ff=32)
    named = list(model.named_parameters())
    names, numels = [n for n, _ in named], [p.numel() for _, p in named]
    for count in (1, 2, 4):
        frags = split_fragments(names, numels, count, layout)
        assert sorted(i for f in frags for i in f) == list(range(len(names)))
        for f in frags:  # a block never straddles two fragments
            for i in f:
                key = block_key(names[i])
                assert key is None or all(j in f for j, n in enumerate(names) if block_key(n) == key)
    strided = split_fragments(names, numels, 2, "strided")
    blocks_of = [sorted({block_key(names[i]) for i in f} - {None}) for f in strided]
    assert blocks_of == [["model.blocks.0", "model.blocks.2"], ["model.blocks.1", "model.blocks.3"]]
    # the schedule: F consecutive rounds sync every fragment once, each every H steps
    settings = IslandSettings(**{**BASE, "sync_every": 8, "fragments": 4, "fragment_layout": layout})
    engine = IslandEngine(settings, CanonicalLayout([(n, tuple(p.shape), False) for n, p in named]), 0, 1,
                          torch.device("cpu"), torch.device("cpu"))
    assert engine.schedule.steps_per_round == 2
    synced = []
    for _ in range(8):
        synced.append(engine.schedule.fragment)
        engine.schedule.advance(0, [{"step_seconds": 1.0}])
    assert synced == [0, 1, 2, 3, 0, 1, 2, 3]


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=30), blocks=st.integers(0, 6),
       count=st.integers(1, 6), layout=st.sampled_from(["strided", "sequential"]))
def test_any_model_splits_into_disjoint_complete_fragments(sizes, blocks, count, layout):
    names = [f"layers.{i % blocks}.w{i}" if blocks else f"p{i}" for i in range(len(sizes))]
    try:
        frags = split_fragments(names, sizes, count, layout)
    except ValueError as err:
        assert "islands.fragments" in str(err)
        return
    assert len(frags) == count and all(frags)
    assert sorted(i for f in frags for i in f) == list(range(len(sizes)))


@pytest.mark.parametrize("kw", [
    {"fragments": 2},
    {"fragments": 2, "overlap_steps": 1},
    {"fragments": 4, "sync_every": 8, "overlap_steps": 1, "overlap_alpha": 0.5, "fragment_layout": "sequential"},
    {"overlap_steps": 3, "overlap_alpha": 0.25},
], ids=["fragments", "fragments+overlap", "4 sequential, alpha", "overlap only"])
def test_streaming_islands_of_different_shardings_agree_and_match_the_reference(kw):
    sizes, steps = [2, 1], 16
    islands = run(sizes, kw, steps)
    expected = reference(sizes, kw, steps)
    first, second = islands
    assert len(first["globals"]) == len(expected) >= 4
    for r, (a, b, ref) in enumerate(zip(first["globals"], second["globals"], expected)):
        assert torch.equal(a, b), f"round {r + 1}: the islands' global states differ"
        torch.testing.assert_close(a.double(), ref, rtol=1e-5, atol=1e-5, msg=f"round {r + 1} vs the reference")
    assert first["digest"] == second["digest"]
    assert {m["islands/fragment"] for m in first["metrics"]} == set(range(kw.get("fragments", 1)))
    if kw.get("overlap_steps"):  # the background thread's waits are not idle time; landing's are
        flown = first["metrics"][0]
        assert flown["islands/seconds_waiting"] >= 0 and "islands/seconds_waiting_in_flight" in flown


def test_a_fragment_merges_by_what_each_island_trained_since_it_last_synced():
    """Tokens and tokens per expert in a round header cover the fragment's last F rounds."""
    kw = {"fragments": 2, "overlap_steps": 1, "expert_weighting": True}
    first, second = run([2, 1], kw, 16, experts=True)
    assert all(torch.equal(a, b) for a, b in zip(first["globals"], second["globals"]))
    assert first["digest"] == second["digest"]
    headers = second["headers"]  # island 1: 1 rank x 7 tokens per step, 2 steps per round
    assert [h["tokens"] for h in headers] == [14.0] + [28.0] * 7
    # the expert parameter lies in fragment 1 (no blocks: parameters dealt out in turn): it merges
    # on odd rounds, by the counts of the round and the one before (1 + e + r each)
    assert [h["experts"] for h in headers[:2]] == [{}, {"experts": [1.0 + 2.0, 2.0 + 3.0, 3.0 + 4.0, 4.0 + 5.0]}]
    assert "islands/expert_share_gap_max" in first["metrics"][1]


def test_the_background_path_landed_at_once_is_the_synchronous_round_bit_for_bit():
    sizes, steps, kw = [2, 1], 12, {"codec": "int4", "exchange_chunk_mib": 0.004}  # several chunks, error feedback
    sync = run(sizes, kw, steps)  # no overlap_steps: the driver runs every round synchronously
    background = run(sizes, kw, steps, mode="land_at_once")
    for a, b in zip(sync, background):
        assert len(a["globals"]) == len(b["globals"]) == 3
        assert all(torch.equal(x, y) for x, y in zip(a["globals"], b["globals"]))
        assert all(torch.equal(x, y) for x, y in zip(a["locals"], b["locals"]))
        assert a["digest"] == b["digest"]


def test_the_background_exchange_reads_the_snapshot_not_parameters_being_trained():
    """The exchange is held back until the island has taken its tau inner steps (and so written
    the parameters again); the round must still merge the values of the sync point."""
    sizes, steps, kw = [1, 1], 12, {"fragments": 2, "overlap_steps": 1}
    free = run(sizes, kw, steps)
    held = run(sizes, kw, steps, gates=[threading.Event(), threading.Event()])
    for a, b in zip(free, held):
        assert all(torch.equal(x, y) for x, y in zip(a["globals"], b["globals"]))
    torch.testing.assert_close(free[0]["globals"][-1].double(), reference(sizes, kw, steps)[-1], rtol=1e-5, atol=1e-5)


def test_an_island_with_a_round_in_flight_heads_for_the_next_round():
    """Its status names the round it trains towards (``heading_round``): the islands that wait for it
    with ``max_staleness`` must not take it for a round behind while its round flies."""
    settings = IslandSettings(**{**BASE, "overlap_steps": 1})
    engine = IslandEngine(settings, CanonicalLayout(SPECS), 0, 1, torch.device("cpu"), torch.device("cpu"))
    locals_ = [CanonicalLayout(SPECS).shard_of(initial_flat(0), i).clone() for i in range(len(SPECS))]
    engine.adopt_initial_state(locals_, {})
    assert engine.heading_round == engine.schedule.round == 0
    engine.count_tokens(4)
    engine.schedule.close_step()
    engine.start(locals_, background=True)
    assert engine.schedule.round == 0 and engine.heading_round == 1
    engine.land(locals_)
    assert engine.schedule.round == engine.heading_round == 1


def test_one_round_in_flight_at_a_time():
    settings = IslandSettings(**{**BASE, "overlap_steps": 1})
    layout = CanonicalLayout(SPECS)
    engine = IslandEngine(settings, layout, 0, 1, torch.device("cpu"), torch.device("cpu"))
    locals_ = [layout.shard_of(initial_flat(0), i).clone() for i in range(len(SPECS))]
    engine.adopt_initial_state(locals_, {})
    engine.count_tokens(1)
    engine.schedule.close_step()
    engine.start(locals_, background=True)
    with pytest.raises(RuntimeError, match="still in flight"):
        engine.start(locals_, background=True)
    metrics, stop = engine.land(locals_)
    assert metrics["islands/round"] == 1 and not stop
    assert engine.land(locals_) == ({}, False)


@pytest.mark.parametrize("kw, match", [
    ({"sync_every": 10, "fragments": 4}, "multiple of 4"),
    ({"sync_every": 8, "fragments": 4, "overlap_steps": 2}, r"\[0, H / F = 2\)"),
    ({"sync_every": 8, "fragments": 0}, "fragments must be"),
    ({"fragment_layout": "random"}, "fragment_layout"),
    ({"overlap_steps": 1, "overlap_alpha": 1.5}, "overlap_alpha"),
    ({"sync_every": 8, "sync_warmup": [2, 4], "fragments": 2, "overlap_steps": 1}, "warm-up"),
])
def test_streaming_settings_are_checked_with_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        IslandSettings(**{**BASE, **kw})


def test_too_many_fragments_for_the_model_names_the_limit():
    with pytest.raises(ValueError, match="at most 4"):
        split_fragments(["a", "b", "c", "d"], [1, 2, 3, 4], 5)


def test_time_balance_budgets_a_fragment_round_of_h_over_f_slowest_steps():
    settings = IslandSettings(**{**BASE, "sync_every": 8, "fragments": 2, "balance": "time", "max_rounds": 10})
    engine = IslandEngine(settings, CanonicalLayout(SPECS), 0, 2, torch.device("cpu"), torch.device("cpu"))
    assert engine.schedule.steps_per_round == 4
    engine.schedule.advance(0, [RoundHeader(0, step_seconds=1.0), RoundHeader(0, step_seconds=2.0)])
    assert engine.schedule.steps_per_round == 8  # 4 steps of the slower island fit 8 of this one


@pytest.mark.parametrize("kw", [
    {"fragments": 2, "overlap_steps": 1, "codec": "int4", "exchange_chunk_mib": 0.004},
    {"overlap_steps": 3, "overlap_alpha": 0.25, "codec": "fp8", "error_feedback": True},
], ids=["fragments+overlap, chunks", "overlap, alpha"])
def test_overlapped_sliced_rounds_equal_the_leaders_bit_for_bit(kw):
    """``exchange=sliced`` with ``overlap_steps``: every rank moves its slices in a thread of its own
    over the island's second group while the ranks train; islands of 3, 2 and 4 ranks end every
    round with the leader path's global state, local parameters and residual, bit for bit."""
    sizes, steps = [3, 2, 4], 16
    leader = run(sizes, kw, steps)
    got = run(sizes, {**kw, "exchange": "sliced"}, steps)
    for a, b in zip(leader, got):
        assert len(a["globals"]) == len(b["globals"]) >= 4
        assert all(torch.equal(x, y) for x, y in zip(a["globals"], b["globals"]))
        assert all(torch.equal(x, y) for x, y in zip(a["locals"], b["locals"]))
        assert a["digest"] == b["digest"]
        flown = b["metrics"][0]
        assert "islands/seconds_waiting_in_flight" in flown and flown["islands/exchange_chunks"] >= 2


def test_an_overlapped_sliced_round_reads_the_snapshot_not_parameters_being_trained():
    """The exchange is held back until the ranks have trained past the sync point; every rank's
    thread still moves the values of the sync point."""
    sizes, steps, kw = [2, 2], 12, {"fragments": 2, "overlap_steps": 1, "exchange": "sliced"}
    free = run(sizes, kw, steps)
    held = run(sizes, kw, steps, gates=[threading.Event(), threading.Event()])
    for a, b in zip(free, held):
        assert all(torch.equal(x, y) for x, y in zip(a["globals"], b["globals"]))
    torch.testing.assert_close(free[0]["globals"][-1].double(), reference(sizes, kw, steps)[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("late", [{2: 1}, {3: 0}], ids=["island 1 late", "the first island late"])
def test_an_island_late_for_an_overlapped_sliced_round_rejoins_as_with_the_leader(late):
    """Island ``late[r]`` misses overlapped round ``r`` (decided without it while its ranks train):
    its every rank's thread learns it, the island takes no step, rejoins at the next round and is
    repaired slice by slice; every island's rounds equal the leader path's, bit for bit."""
    sizes, kw = [2, 3, 2], {"fragments": 2, "overlap_steps": 1, "codec": "int4"}
    leader = run(sizes, kw, 16, late=late)
    got = run(sizes, {**kw, "exchange": "sliced"}, 16, late=late)
    missed = next(iter(late.values()))
    assert len(got[missed]["globals"]) < len(got[(missed + 1) % 3]["globals"]), "the late island skipped a round"
    assert sum(m["islands/islands_repaired"] for m in got[(missed + 1) % 3]["metrics"]) >= 1
    for a, b in zip(leader, got):
        assert len(a["globals"]) == len(b["globals"])
        assert all(torch.equal(x, y) for x, y in zip(a["globals"], b["globals"]))
        assert a["digest"] == b["digest"] == got[0]["digest"]
