"""The sliced exchange (``islands.exchange=sliced``): every rank moves its own slice of the fragment.

Islands and their ranks are threads (the engine harness of ``test_engine``); rank 0's lanes are the
in-memory link, every other rank's an in-memory :class:`~lightning_islands.link.protocol.RankLink`.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from doubles import Hub, MemoryLink, MemoryRankLink, ThreadGroup, ThreadIsland, run_threads
from test_engine import NUMEL, SPECS, Plan, assert_identical, leaders, reference, run

from lightning_islands.codecs import make_codec
from lightning_islands.engine import CanonicalLayout, IslandSettings
from lightning_islands.engine.header import RoundHeader
from lightning_islands.engine.island import Island
from lightning_islands.engine.merging import MergePlan
from lightning_islands.engine.slice_moves import slice_bounds, slice_count
from lightning_islands.engine.sliced import exchange_sliced
from lightning_islands.link.protocol import RoundLost


def forbid_gather_inside(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, what: str
                         ) -> tuple[threading.local, list[tuple[tuple, Any]]]:
    """Patch ``owner.name`` so that ``CanonicalLayout.gather_to_leader`` fails inside it (``what``
    names the path that must not gather); returns the flag (``inside.on`` while it runs, for other
    spies) and its calls as ``(args, result)``."""
    inside, calls = threading.local(), []
    real, gather = getattr(owner, name), CanonicalLayout.gather_to_leader

    def spy_gather(self, *args, **kwargs):
        assert not getattr(inside, "on", False), f"{what} gathered to one rank"
        return gather(self, *args, **kwargs)

    def flagged(*args, **kwargs):
        inside.on = True
        try:
            calls.append((args, real(*args, **kwargs)))
            return calls[-1][1]
        finally:
            inside.on = False

    monkeypatch.setattr(CanonicalLayout, "gather_to_leader", spy_gather)
    monkeypatch.setattr(owner, name, flagged)
    return inside, calls


@pytest.mark.parametrize("numel, count, alignment", [(7440, 3, 128), (100, 4, 64), (10, 3, 1), (1 << 20, 7, 256),
                                                     (100, 2, 128), (5000, 3, 2048)])
def test_slices_cover_the_vector_in_order_on_whole_blocks(numel, count, alignment):
    bounds = slice_bounds(numel, count, alignment)
    assert len(bounds) == count and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a == b_prev for (_, b_prev), (a, _) in zip(bounds, bounds[1:]))
    assert all(a <= b and (a % alignment == 0 or a == b == numel) for a, b in bounds)
    blocks = [-(-(b - a) // alignment) for a, b in bounds]  # as even as whole blocks allow
    assert max(blocks) - min(blocks) <= 1
    assert blocks == sorted(blocks, reverse=True) and bounds[0][1] > 0, "rank 0, which reports, owns a slice"


def test_the_smallest_island_present_sets_the_slices():
    headers = [RoundHeader(0, ranks=4), RoundHeader.absent_from(0), RoundHeader(0, ranks=3)]
    assert slice_count(headers) == 3


@pytest.mark.parametrize("sizes, codec", [
    *[(sizes, "fp32") for sizes in ([1, 2, 3], [2, 3], [3, 2], [4, 4], [4, 2, 3])],
    *[(sizes, codec) for sizes in ([2, 3], [4, 2, 3]) for codec in ("int4", "fp8", "sign")]])
def test_sliced_rounds_equal_the_leaders_bit_for_bit(sizes, codec):
    """Codecs that quantize block by block give the leader path's bits, islands of any ranks."""
    settings = {"codec": codec, "error_feedback": codec != "fp32"}
    leader = assert_identical(run(Plan(sizes=sizes, tokens=[4, 5, 6][: len(sizes)], settings=settings)))
    results = run(Plan(sizes=sizes, tokens=[4, 5, 6][: len(sizes)], settings={**settings, "exchange": "sliced"}))
    got = assert_identical(results)
    assert all(torch.equal(a, b) for a, b in zip(leader, got))
    for (island, rank), res in results.items():  # every rank holds its shards of the global state
        layout = CanonicalLayout(SPECS, ThreadGroup(ThreadIsland(sizes[island]), rank))
        for i, anchor in enumerate(res["state"]["anchor"]):
            assert torch.equal(anchor, layout.shard_of(got[-1], i)), (island, rank, SPECS[i][0])


def test_sliced_rounds_match_reference_diloco_and_count_every_slices_bytes():
    plan = Plan(sizes=[2, 3], tokens=[8, 3], settings={"exchange": "sliced"})
    results = run(plan)
    got = assert_identical(results)
    for r, want in enumerate(reference(plan)):
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)
    m = leaders(results)[0]["metrics"][-1]
    assert m["islands/payload_bytes"] == pytest.approx(NUMEL * 4 + 2 * 32, rel=0.01)  # two slices, fp32
    assert m["islands/bytes_sent"] == pytest.approx(m["islands/payload_bytes"])  # one peer, summed over the ranks
    assert m["islands/exchange_chunks"] == 2
    assert m["islands/cosine"] == pytest.approx(leaders(run(Plan(sizes=[2, 3], tokens=[8, 3])))[0]["metrics"][-1][
        "islands/cosine"], rel=1e-9)


@pytest.mark.parametrize("codec", ["topk:0.2+int2", "int2"])
def test_sliced_rounds_with_fragments_and_selecting_codecs_stay_identical(codec):
    settings = {"codec": codec, "error_feedback": True, "fragments": 2, "sync_every": 4, "exchange": "sliced"}
    got = assert_identical(run(Plan(sizes=[3, 2], tokens=[4, 4], rounds=4, settings=settings)))
    assert not torch.equal(got[0], got[1])


def test_no_rank_holds_more_than_its_slice(monkeypatch):
    """The leader path gathers the fragment to rank 0; sliced, each owner receives its slice and no
    rank gathers more (a rank beyond the smaller island's count receives none)."""
    from lightning_islands.engine import sliced

    sizes, owned, to_owners = [3, 2], [], CanonicalLayout.to_owners
    inside, _ = forbid_gather_inside(monkeypatch, sliced, "exchange_sliced", "the sliced round")

    def spy_owners(self, locals_, bounds, device, out_device=None):
        got = to_owners(self, locals_, bounds, device, out_device)
        if getattr(inside, "on", False):  # the round's (the start moves copies of the bias too)
            owned.append((self.group.size, self.group.rank, None if got is None else got.numel()))
        return got

    monkeypatch.setattr(CanonicalLayout, "to_owners", spy_owners)
    assert_identical(run(Plan(sizes=sizes, tokens=[4, 4], rounds=1, settings={"exchange": "sliced", "codec": "int4"})))
    alignment = make_codec("int4").alignment
    blocks = -(-NUMEL // alignment)
    largest = -(-blocks // 2) * alignment  # two slices: the smaller island has two ranks
    assert sorted(owned) == [(2, 0, largest), (2, 1, NUMEL - largest), (3, 0, largest), (3, 1, NUMEL - largest),
                             (3, 2, None)]
    assert largest < NUMEL


def _one_island(fail: dict[int, Exception], before: dict[int, tuple[str, str]] | None = None,
                no_lanes: tuple[int, ...] = ()) -> list:
    """Island 0 of two, its two ranks as threads, alone in a round (island 1 absent; present in the
    headers when some rank has no lanes, ``no_lanes``): rank r's lanes raise ``fail[r]`` at their
    first transfer; ``before[r]``: rank r failed before the exchange."""
    hub, shared = Hub(2), ThreadIsland(2)
    other = RoundHeader(0, tokens=1.0, steps=1, norm=1.0, ranks=2) if no_lanes else RoundHeader.absent_from(0)
    headers = [RoundHeader(0, tokens=1.0, steps=1, norm=1.0, ranks=2), other]

    class Failing(MemoryRankLink):
        def all_gather_bytes(self, payload, limit=None):
            if self.rank in fail:
                raise fail[self.rank]
            return super().all_gather_bytes(payload, limit)

    def rank_main(rank: int) -> object:
        group = ThreadGroup(shared, rank)
        layout = CanonicalLayout(SPECS, group)
        side = Island(0, 2, group)
        side.link = MemoryLink(hub, 0) if rank == 0 else None
        link = None if rank in no_lanes else Failing(hub, 0, rank)
        if link is not None:
            link.use((0,), None)
        plan = MergePlan.of(headers, "tokens", None, layout)
        sent = [layout.shard_of(torch.ones(NUMEL), i) for i in range(len(SPECS))]
        try:
            exchange_sliced(side, layout, IslandSettings().make_codec(), link, plan, sent, sent, None, 1.0, 2, None,
                            torch.device("cpu"), torch.device("cpu"), (before or {}).get(rank))
        except Exception as err:  # noqa: BLE001 - what each rank raised is the result
            return err
        return None

    return run_threads([lambda r=r: rank_main(r) for r in range(2)])


def test_a_lost_slice_runs_the_round_again_on_every_rank():
    got = _one_island({1: RoundLost("rank 1 of island 0 lost its peer (injected)")})
    assert all(isinstance(e, RoundLost) for e in got), got
    assert all("rank 1's slice" in str(e) and "injected" in str(e) for e in got)


def test_a_rank_whose_lanes_could_not_be_built_runs_the_round_again_with_its_island():
    got = _one_island({}, before={1: ("lost", "rank 1 of island 0 gave up building its lanes (injected)")})
    assert all(isinstance(e, RoundLost) and "building its lanes" in str(e) for e in got), got


def test_a_rank_without_lanes_of_its_own_ends_the_island_instead_of_merging_alone():
    """With another island present, a slice's owner without lanes would merge its slice with nobody's."""
    got = _one_island({}, no_lanes=(0, 1))
    assert all(type(e) is RuntimeError and "rank 0 of island 0 has no lanes of its own" in str(e) for e in got), got


def test_a_slice_that_fails_otherwise_ends_the_island_naming_the_rank():
    got = _one_island({1: ValueError("payload checksum mismatch (injected)")})
    assert all(type(e) is RuntimeError for e in got), got
    assert all("rank 1's slice exchange failed: ValueError: payload checksum mismatch" in str(e) for e in got)


def test_an_unknown_exchange_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="exchange must be one of"):
        IslandSettings(exchange="everyone")


SECRET = b"s" * 32


def _real_islands(run_id: str, secrets: tuple[bytes | None, bytes | None] = (None, None),
                  rank_secrets: tuple[bytes | None, bytes | None] | None = None) -> tuple[Any, list, list]:
    """A coordinator of this process (keep it referenced: it serves while it lives), two islands'
    links (rank 0's) and rank 1's own lanes; with ``secrets``, each island's are wrapped to sign and
    check (``rank_secrets``: rank 1's, default the same)."""
    from lightning_islands.link.auth import AuthenticatedLink, AuthenticatedRankLink
    from lightning_islands.link.coordinator import Coordinator
    from lightning_islands.link.island_link import IslandLink
    from lightning_islands.link.rank_lanes import RankLanes

    coordinator = Coordinator()
    rank_secrets = secrets if rank_secrets is None else rank_secrets
    links, ranks = [], []
    for i in range(2):
        link = IslandLink(coordinator.address, i, 2, run_id=run_id, lanes=2, secret=secrets[i])
        links.append(AuthenticatedLink(link, secrets[i], run_id) if secrets[i] else link)
        lanes = RankLanes(coordinator.address, i, 1, 2, run_id=run_id, lanes=2, grace_s=30.0)
        ranks.append(AuthenticatedRankLink(lanes, rank_secrets[i], run_id, 1) if rank_secrets[i] else lanes)
    return coordinator, links, ranks


def _over_real_lanes(plan: Plan, links: list, ranks: list) -> list:
    """Every rank of ``plan``'s two islands of two ranks (threads): rank 0 over its island's link,
    rank 1 over its own lanes; each rank's global state after each round (``None`` off the leader),
    or the error it raised."""
    from test_engine import initial_flat, inner_steps

    from lightning_islands.engine import IslandEngine

    shared = [ThreadIsland(2) for _ in range(2)]

    def rank_main(island: int, rank: int) -> list[torch.Tensor]:
        settings = IslandSettings(sync_every=3, outer_lr=0.7, outer_momentum=0.9, exchange="sliced", **plan.settings)
        layout = CanonicalLayout(SPECS, ThreadGroup(shared[island], rank))
        engine = IslandEngine(settings, layout, island, 2, torch.device("cpu"), torch.device("cpu"))
        locals_ = [layout.shard_of(initial_flat(island), k).clone() for k in range(len(SPECS))]
        engine.meet(lambda: links[island], settings.fingerprint(layout, False, "cpu"),
                    open_rank_link=lambda: ranks[island])
        engine.adopt_initial_state(locals_, {})
        out = []
        for _ in range(plan.rounds):
            inner_steps(engine, locals_, island, plan.tokens[island])
            engine.run_round(locals_)
            flat = engine.global_flat()
            out.append(None if flat is None else flat.clone())
        return out

    def guarded(island: int, rank: int) -> object:
        try:
            return rank_main(island, rank)
        except Exception as err:  # noqa: BLE001 - what each rank raised is the result
            return err

    got = run_threads([lambda i=i, r=r: guarded(i, r) for i in range(2) for r in range(2)])
    for link in [*links, *ranks]:
        link.close()
    return got


@pytest.mark.parametrize("secret, topology", [(None, "allreduce"), (SECRET, "allreduce"), (SECRET, "butterfly")],
                         ids=["plain", "signed", "butterfly-signed"])
def test_the_real_lanes_of_every_rank_give_the_leaders_bits(secret, topology):
    """Two islands of two ranks (threads) over the coordinator: rank 0 of each over its island's
    link, rank 1 over lanes of its own (:class:`RankLanes`; with a secret, every rank's payloads
    signed and checked; the butterfly swaps instead of all-gathering); the global state equals the
    leader path's in memory, bit for bit."""
    plan = Plan(sizes=[2, 2], tokens=[4, 6], rounds=2, settings={"codec": "int4", "error_feedback": True,
                                                                 "topology": topology})
    coordinator, links, ranks = _real_islands(f"sliced-{secret is not None}-{topology}", (secret, secret))
    got = _over_real_lanes(plan, links, ranks)
    assert not any(isinstance(g, Exception) for g in got), got
    leader = leaders(run(plan))  # (the butterfly's islands keep momentum of their own: compared island by island)
    for flats, want in zip((got[0], got[2]), leader):  # the leaders' view of the global state after each round
        assert len(flats) == len(want["rounds"]) and all(torch.equal(a, b) for a, b in zip(flats, want["rounds"]))
    if secret:
        assert all(r.rank == 1 and r._epoch.endswith("/rank1") and r._seq > 0 for r in ranks), "rank 1 signed"


def test_a_rank_whose_secret_differs_ends_every_island_naming_its_slice(caplog):
    """Rank 1 of island 1 signs with another secret: rank 1 of island 0 refuses its payload, and
    every rank of both islands ends with an error that names the slice and the fix; already at the
    start, where island 1 (built from another seed) takes island 0's parameters slice by slice."""
    plan = Plan(sizes=[2, 2], tokens=[4, 6], rounds=1, settings={"codec": "int4", "error_feedback": True})
    coordinator, links, ranks = _real_islands("sliced-forged", (SECRET, SECRET), (SECRET, b"t" * 32))
    got = _over_real_lanes(plan, links, ranks)
    assert all(isinstance(g, Exception) for g in got), got
    assert "rank 1's slice of island 0's parameters failed: AuthenticationError" in str(got[0])  # island 0 refused
    assert "does not match its tag" in str(got[0]) and "same secret" in str(got[0])
    assert "does not match its tag" in caplog.text


@pytest.mark.parametrize("first, then", [("leader", "sliced"), ("sliced", "leader")])
def test_a_resume_may_change_the_exchange(first, then):
    """The outer state lives in the shards whichever ranks move the bytes: a run checkpointed with
    one exchange resumes with the other and goes on as a run that never stopped (block codecs give
    both the same bits)."""
    settings = {"codec": "int4", "error_feedback": True}
    straight = assert_identical(run(Plan(sizes=[2, 3], tokens=[4, 6], rounds=4, settings=settings)))
    half = run(Plan(sizes=[2, 3], tokens=[4, 6], rounds=2, settings={**settings, "exchange": first}))
    resumed = run(Plan(sizes=[2, 3], tokens=[4, 6], rounds=4, settings={**settings, "exchange": then}), resume=half)
    assert all(torch.equal(a, b) for a, b in zip(straight[2:], assert_identical(resumed)))


def test_the_rounds_bytes_add_up_over_the_slices_and_its_seconds_are_the_slowest_ranks():
    """The slices move side by side: the island's bytes are every rank's, its seconds the slowest's."""
    from lightning_islands.engine.exchange import ChunkExchange
    from lightning_islands.engine.sliced import _sum_stats

    shared = ThreadIsland(2)
    headers = [RoundHeader(0, tokens=1.0, steps=1, norm=1.0, ranks=2), RoundHeader(0, tokens=1.0, steps=1, norm=1.0)]

    def rank_main(rank: int) -> tuple[int, dict]:
        group = ThreadGroup(shared, rank)
        layout = CanonicalLayout(SPECS, group)
        exchange = ChunkExchange(make_codec("int4"), None, 0, MergePlan.of(headers, "tokens", None, layout), layout,
                                 1.0, False)
        exchange.link_sums.update(bytes_sent=10.0 * (rank + 1), seconds_exchanging=1.0 + 2 * rank,
                                  seconds_waiting=0.5 - 0.25 * rank)
        exchange.stats.payload_bytes = 100 * (rank + 1)
        chunks = _sum_stats(group, exchange, 3 + rank)
        return chunks, dict(exchange.link_sums, payload_bytes=exchange.stats.payload_bytes)

    (chunks, lead), (_, other) = run_threads([lambda r=r: rank_main(r) for r in range(2)])
    assert chunks == 7 and lead["payload_bytes"] == 300
    assert lead["bytes_sent"] == 30.0 and lead["seconds_exchanging"] == 3.0 and lead["seconds_waiting"] == 0.5
    assert other["bytes_sent"] == 20.0, "only the leader's exchange takes the island's totals"


def test_slices_moved_a_chunk_at_a_time_give_the_same_bits_and_hold_one_chunk(monkeypatch):
    """With ``exchange_chunk_mib`` below a slice, every slice moves in chunks side by side: the bits
    are the leader path's, and no rank receives more than a chunk at a time."""
    settings = {"codec": "int4", "error_feedback": True}
    leader = assert_identical(run(Plan(sizes=[2, 3], tokens=[4, 6], settings=settings)))
    received, to_owners = [], CanonicalLayout.to_owners

    def spy(self, locals_, bounds, device, out_device=None):
        got = to_owners(self, locals_, bounds, device, out_device)
        received.append(0 if got is None else got.numel())
        return got

    monkeypatch.setattr(CanonicalLayout, "to_owners", spy)
    chunked = {**settings, "exchange": "sliced", "exchange_chunk_mib": 2048 * 4 / 2**20}  # 2048 values
    results = run(Plan(sizes=[2, 3], tokens=[4, 6], settings=chunked))
    assert all(torch.equal(a, b) for a, b in zip(leader, assert_identical(results)))
    assert max(received) == 2048 and leaders(results)[0]["metrics"][0]["islands/exchange_chunks"] == 4


def test_a_fragment_of_fewer_blocks_than_slices_still_reports_its_round():
    """Three slices of a fragment of two int4 blocks: the empty slice is the last rank's, so rank 0
    (which reports the round) owns one, and the bits are the leader path's."""
    settings = {"codec": "int4", "error_feedback": True, "fragments": 2, "sync_every": 4}
    leader = assert_identical(run(Plan(sizes=[3, 3], tokens=[4, 4], rounds=2, settings=settings)))
    results = run(Plan(sizes=[3, 3], tokens=[4, 4], rounds=2, settings={**settings, "exchange": "sliced"}))
    assert all(torch.equal(a, b) for a, b in zip(leader, assert_identical(results)))
    assert all(m.get("islands/payload_bytes", 0) > 0 for m in leaders(results)[0]["metrics"])


def test_a_slice_lost_past_the_rounds_deadline_ends_the_run_instead_of_retrying():
    """``Link.fail_round`` marks the attempt failed and runs the round again, until the round's
    deadline (``deadline_s``) has passed: then it ends the run, naming the deadline."""
    import time
    from datetime import timedelta

    from lightning_islands.link.coordinator import Coordinator
    from lightning_islands.link.island_link import IslandLink
    from lightning_islands.link.protocol import DeadlinePassed

    coordinator = Coordinator()
    links = [IslandLink(coordinator.address, i, 2, run_id="deadline", lanes=1, deadline=timedelta(seconds=2))
             for i in range(2)]
    run_threads([link.open_lanes for link in links])
    run_threads([lambda link=link: link.meet_round(0, {}) for link in links])
    first = links[0].fail_round("rank 1's slice: lost (injected)")
    assert type(first) is RoundLost and "the round runs again" in str(first)
    while time.monotonic() <= links[0].membership.deadline(0):  # the deadline itself is the event
        time.sleep(0.05)
    late = links[0].fail_round("rank 1's slice: lost (injected)")
    assert isinstance(late, DeadlinePassed) and "deadline_s=2 s" in str(late)
    for link in links:
        link.close()
    del coordinator


@pytest.mark.parametrize("kw", [{"codec": "int4", "exchange_chunk_mib": 1024 * 4 / 2**20},
                                {"fragments": 2, "overlap_steps": 1}], ids=["chunks", "fragments+overlap"])
def test_a_drifted_island_is_repaired_slice_by_slice_as_the_leader_would(kw, monkeypatch, caplog):
    """One bit of island 1's anchors flips after round 1: with ``exchange=sliced`` the majority's
    first island sends its anchors and momentum slice by slice, chunk by chunk, rank to rank (no
    rank gathers the state), and every island ends every later round as the leader path's repair
    leaves it, bit for bit."""
    from test_streaming import run as run_streaming

    from lightning_islands.engine import sliced_repair

    sizes = [3, 2, 3]
    leader = run_streaming(sizes, kw, 16, corrupt=(1, 1))
    _, calls = forbid_gather_inside(monkeypatch, sliced_repair, "repair_sliced", "the sliced repair")
    got = run_streaming(sizes, {**kw, "exchange": "sliced"}, 16, corrupt=(1, 1))
    repaired = [m["islands/islands_repaired"] for m in got[0]["metrics"]]
    assert sum(repaired) == 1.0 and 1 in [result for _, result in calls], repaired
    assert "taking island 0's, slice by slice" in caplog.text
    for a, b in zip(leader, got):
        assert len(a["globals"]) == len(b["globals"])
        assert all(torch.equal(x, y) for x, y in zip(a["globals"], b["globals"]))
        assert a["digest"] == b["digest"] == got[0]["digest"]


def test_a_ranks_transfer_gives_up_once_another_island_marks_the_attempt_failed():
    """Rank 1 of island 1 builds its lanes and then goes silent (no reset): rank 1 of island 0, in
    an all-gather with a deadline of a minute, gives up as soon as a leader marks the round's
    attempt failed at the coordinator (as the leaders' links do on a lost island), not at its deadline."""
    from lightning_islands.link.coordinator import Coordinator
    from lightning_islands.link.rank_lanes import RankLanes

    coordinator = Coordinator()
    ranks = [RankLanes(coordinator.address, i, 1, 2, run_id="watch", lanes=1, grace_s=30.0) for i in range(2)]
    run_threads([lambda r=r: r.use((0, 1), "round0/a0", "round0/a0") for r in ranks])
    box: dict[str, BaseException] = {}
    started = threading.Event()

    def gather() -> None:
        started.set()
        try:
            ranks[0].all_gather_bytes(torch.ones(8, dtype=torch.uint8))
        except BaseException as err:  # noqa: BLE001 - the test reads it
            box["error"] = err

    t = threading.Thread(target=gather)
    t.start()
    started.wait()
    coordinator.store.set("watch/round0/a0/outcome", "fail")  # island 0's leader lost island 1
    t.join(timeout=25)  # well inside the transfer's own deadline (2 x grace_s = 60 s)
    assert not t.is_alive(), "the transfer did not give up when the attempt was marked failed"
    assert isinstance(box.get("error"), RoundLost) and "failed on another island" in str(box["error"])
    for r in ranks:
        r.close()


def test_a_lone_island_moves_its_slices_too_and_no_rank_gathers_the_fragment(monkeypatch):
    """An island training alone with ``exchange=sliced`` (synchronous and overlapped rounds): every
    rank encodes and decodes its own slice, merging with nobody, and the rounds equal the leader
    path's bit for bit; nothing is gathered to one rank."""
    from test_streaming import run as run_streaming

    settings = {"codec": "int4", "error_feedback": True, "exchange_chunk_mib": 1024 * 4 / 2**20}
    leader = leaders(run(Plan(sizes=[3], tokens=[4], settings=settings)))
    flying = run_streaming([3], {**settings, "overlap_steps": 1}, 12)

    def refuse(*args, **kwargs):
        raise AssertionError("a sliced round took the leader's path (the fragment gathered to rank 0)")

    from lightning_islands.engine import flight
    from lightning_islands.engine import round as engine_round

    monkeypatch.setattr(engine_round, "exchange_chunks", refuse)  # the leader path's chunk loop
    monkeypatch.setattr(flight, "fly", refuse)  # and its overlapped round
    got = leaders(run(Plan(sizes=[3], tokens=[4], settings={**settings, "exchange": "sliced"})))
    assert all(torch.equal(a, b) for a, b in zip(leader[0]["rounds"], got[0]["rounds"]))
    assert got[0]["metrics"][-1]["islands/exchange_chunks"] > 3
    flown = run_streaming([3], {**settings, "overlap_steps": 1, "exchange": "sliced"}, 12)
    assert len(flown[0]["globals"]) == len(flying[0]["globals"]) == 3
    assert all(torch.equal(a, b) for a, b in zip(flying[0]["globals"], flown[0]["globals"]))


def test_lanes_a_lost_repair_broke_fail_the_next_attempt_under_their_key_at_once(monkeypatch):
    """A repair transfer lost after its round counted leaves a rank's lanes of that round's key broken
    (its peers still hold theirs): when the next round keeps the key, the island's ranks beyond 0
    fail the attempt at once (without building lanes anew under a used key, which would leave the
    peers waiting until the transfer's deadline), so that the round runs again on new lanes; under
    any other key, and afterwards, they use their lanes as usual."""
    from lightning_islands.engine import IslandEngine, sliced_repair

    hub, islands = Hub(2), [ThreadIsland(2), ThreadIsland(2)]
    monkeypatch.setattr(sliced_repair, "needed", lambda headers: True)

    def lost(*args, **kwargs):
        raise RoundLost("rank 1's slice of the repair: lost its peer (injected)")

    monkeypatch.setattr(sliced_repair, "repair_sliced", lost)
    rank_links: dict[tuple[int, int], MemoryRankLink] = {}

    def rank_main(i: int, rank: int) -> list[Any]:
        group = ThreadGroup(islands[i], rank)
        layout = CanonicalLayout(SPECS, group)
        s = IslandSettings(sync_every=2, exchange="sliced")
        engine = IslandEngine(s, layout, i, 2, torch.device("cpu"), torch.device("cpu"))
        rank_links[i, rank] = MemoryRankLink(hub, i, rank)
        engine.meet(lambda: MemoryLink(hub, i), s.fingerprint(layout, False, "cpu"),
                    open_rank_link=lambda: rank_links[i, rank])
        engine.side.on_leader(lambda link: setattr(link, "lanes_key", "round3/a0"))
        locals_ = [layout.shard_of(torch.zeros(NUMEL), k) for k in range(len(SPECS))]
        headers = [RoundHeader(3, steps=1, ranks=2), RoundHeader(3, steps=1, ranks=2)]
        if i == 0:  # island 0's repair is lost (the round had counted): nothing is raised, its lanes are marked
            assert engine._repair_counted(headers, locals_) == 0
        failed = [engine.rank_lanes(2)[1]]  # the next round keeps the key
        failed.append(engine.rank_lanes(2)[1])  # and the one after (its retry would name new lanes)
        return failed

    got = run_threads([lambda i=i, r=r: rank_main(i, r) for i in range(2) for r in range(2)])
    (i0r0, i0r1, i1r0, i1r1) = got
    assert i0r1[0] is not None and i0r1[0][0] == "lost" and "lost its lanes of round3/a0" in i0r1[0][1], i0r1
    assert i0r0 == [None, None], "rank 0's lanes are the island link's: nothing to rebuild"
    assert i0r1[1] is None and i1r0 == i1r1 == [None, None]
    # island 0's rank 1 did not build lanes under the broken key; then it used them like the others
    assert [key for _, key in rank_links[0, 1].used] == ["round3/a0", "round3/a0"]  # the repair's, the third call's
    assert [key for _, key in rank_links[1, 1].used] == ["round3/a0", "round3/a0"]


def _start(sizes: list[int], exchange: str, seeds: list[int], skew_copies: bool) -> dict[tuple[int, int], Any]:
    """Islands of ``sizes`` ranks (threads) built from ``seeds`` meet and take island 0's state; with
    ``skew_copies`` rank 1 of every island holds its own copy of the replicated ``bias``. Returns each
    rank's parameters afterwards, whether the state was sent, and the whole anchors (by canonical
    layout) on the leader."""
    from test_engine import initial_flat

    from lightning_islands.engine import IslandEngine

    hub = Hub(len(sizes))
    shared = [ThreadIsland(n) for n in sizes]

    def rank_main(island: int, rank: int) -> dict[str, Any]:
        settings = IslandSettings(exchange=exchange, exchange_chunk_mib=1024 * 4 / 2**20)
        layout = CanonicalLayout(SPECS, ThreadGroup(shared[island], rank))
        engine = IslandEngine(settings, layout, island, len(sizes), torch.device("cpu"), torch.device("cpu"))
        locals_ = [layout.shard_of(initial_flat(seeds[island]), k).clone() for k in range(len(SPECS))]
        if skew_copies and rank == 1:
            locals_[2].add_(1.0)  # "bias": every rank holds all of it; rank 0's copy is the one gathered
        engine.meet(lambda: MemoryLink(hub, island), settings.fingerprint(layout, False, "cpu"),
                    open_rank_link=lambda: MemoryRankLink(hub, island, rank))
        engine.adopt_initial_state(locals_, {"step": torch.tensor([float(seeds[island])])})
        got = {"locals": locals_, "sent": engine.initial_state_broadcast, "anchors": engine.global_flat(),
               "digest": engine._start_digest()}
        if rank == min(island, sizes[island] - 1):  # one rank of each island flips one bit of a value it owns
            engine.state.anchors[0].view(-1)[-1:].view(torch.int32).bitwise_xor_(1)
        got["flipped"] = engine._start_digest()
        return got

    jobs = [lambda i=i, r=r: rank_main(i, r) for i, n in enumerate(sizes) for r in range(n)]
    return dict(zip([(i, r) for i, n in enumerate(sizes) for r in range(n)], run_threads(jobs)))


@pytest.mark.parametrize("seeds", [[0, 1, 2], [5, 5, 5]], ids=["different", "same"])
def test_islands_take_island_0s_state_slice_by_slice_at_the_start(seeds, monkeypatch):
    """``exchange=sliced`` at the start: the islands compare checksums that do not depend on their
    sharding, and those built otherwise than island 0 take its parameters slice by slice, rank to
    rank; no rank gathers the model, copies of a replicated parameter take their owner's values,
    and every rank ends as the leader path leaves it, bit for bit. Built alike, nothing is sent."""
    from lightning_islands.engine import rendezvous

    sizes, moved, move = [3, 2, 4], [], rendezvous.move_slices

    def spy_move(*args, **kwargs):
        moved.append(kwargs["slices"])
        return move(*args, **kwargs)

    leader = _start(sizes, "leader", seeds, skew_copies=True)
    forbid_gather_inside(monkeypatch, rendezvous, "adopt_initial_state_sliced", "the sliced start")
    monkeypatch.setattr(rendezvous, "move_slices", spy_move)
    got = _start(sizes, "sliced", seeds, skew_copies=True)
    different = seeds[0] != seeds[1]
    assert moved == ([2] * 9 if different else []), moved  # every rank, over the smallest island's two slices
    for key, want in leader.items():
        assert got[key]["sent"] is want["sent"] is different
        assert all(torch.equal(a, b) for a, b in zip(want["locals"], got[key]["locals"])), key
    first = got[0, 0]["anchors"]
    for i in range(len(sizes)):
        assert torch.equal(got[i, 0]["anchors"], first) and torch.equal(leader[i, 0]["anchors"], first)
        assert got[i, 0]["digest"] == got[0, 0]["digest"]  # the start agreement's, gathering nothing either
    # each island's one flipped bit, at its own canonical place, shows in its checksum
    assert len({got[0, 0]["digest"]} | {got[i, 0]["flipped"] for i in range(len(sizes))}) == 1 + len(sizes)
