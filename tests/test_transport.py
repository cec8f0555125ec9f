"""Coordinator and island links in one process (real TCPStore, real gloo lanes in threads)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_islands.link.coordinator import Coordinator, parse_address
from lightning_islands.link.island_link import IslandLink
from lightning_islands.link.protocol import DeadlinePassed, IslandAborted, PayloadRefused


def test_parse_address_names_the_fix():
    assert parse_address("127.0.0.1:29400") == ("127.0.0.1", 29400)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address("localhost")


def test_duplicate_island_index_or_reused_run_id_is_refused():
    coord = Coordinator()
    IslandLink(coord.address, 0, 2, run_id="r1")
    with pytest.raises(RuntimeError, match="already joined run 'r1'"):
        IslandLink(coord.address, 0, 2, run_id="r1")
    IslandLink(coord.address, 0, 2, run_id="r2")  # a fresh run id is fine


def test_waiting_island_learns_of_a_failed_island_a_stopped_one_and_missing_ones():
    coord = Coordinator()
    a = IslandLink(coord.address, 0, 2, run_id="r", grace_s=1, deadline=timedelta(seconds=4))
    b = IslandLink(coord.address, 1, 2, run_id="r", grace_s=1)
    # island 1's process runs (it beats) but it never comes: waited for until the deadline
    with pytest.raises(DeadlinePassed, match=r"islands \[1\] did not reach 'round0' within deadline_s=4 s.*"
                                             r"raise islands.deadline_s"):
        a.gather_objects("round0", {"x": 1})
    b.alive.stop()  # seen beating, then silent: given up after grace_s, before the deadline
    with pytest.raises(IslandAborted, match=r"islands \[1\] did not reach 'round1' and showed no progress for 1 s"):
        a.gather_objects("round1", {"x": 1})
    b.abort("island 1: RuntimeError: out of memory")
    with pytest.raises(IslandAborted, match="island 1 failed: island 1: RuntimeError: out of memory"):
        a.gather_objects("round2", {"x": 1})


def _wait_for(a: IslandLink, other_island) -> float:
    """Island 0 (``a``) gathers 'round0' while ``other_island`` runs in a thread and gathers it too;
    returns how long island 0 waited."""
    t = threading.Thread(target=other_island)
    t.start()
    started = time.monotonic()
    assert a.gather_objects("round0", {"island": 0}) == [{"island": 0}, {"island": 1}]
    waited = time.monotonic() - started
    t.join(timeout=30)
    return waited


def test_reading_a_key_that_may_vanish_never_waits_for_it():
    """get_if_set reads in one request: a key deleted right after a check saw it (the sweeper, a
    join request withdrawn) made the check-then-get wait out the store's timeout, or read empty."""
    from lightning_islands.link.coordinator import get_if_set

    coord = Coordinator()
    store = dist.TCPStore("127.0.0.1", coord.port, is_master=False, timeout=timedelta(seconds=2))

    class Sweeping:  # deletes the key as soon as a check has seen it
        def check(self, keys: list[str]) -> bool:
            found = store.check(keys)
            store.delete_key(keys[0])
            return found

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

    store.set("k", "v")
    started = time.monotonic()
    assert get_if_set(Sweeping(), "k") == b"v"
    assert get_if_set(store, "missing") is None and not store.check(["missing"]), "nothing is written"
    store.set("empty", "")
    assert get_if_set(store, "empty") == b""
    assert time.monotonic() - started < 1.5


def test_the_last_status_published_is_written_by_close():
    """Statuses go out from a thread of their own; close() writes the one still pending first."""
    coord = Coordinator()
    link = IslandLink(coord.address, 0, 1, run_id="r")
    for step in range(50):
        link.heartbeat({"step": step})
    link.close()
    assert coord.status(1, "r")[0] == {"step": 49}


def test_a_slow_island_that_makes_progress_is_waited_for_past_the_grace_window():
    coord = Coordinator()
    a = IslandLink(coord.address, 0, 2, run_id="r", grace_s=1.5, deadline=timedelta(seconds=60))
    b = IslandLink(coord.address, 1, 2, run_id="r", grace_s=1.5)
    b.alive.settle()  # as after its first round: its beat follows its progress
    done = threading.Event()

    def slow_island() -> None:  # 4 s of steps, a heartbeat every 0.25 s, then it arrives
        for step in range(16):
            b.heartbeat(step)
            time.sleep(0.25)
        b.gather_objects("round0", {"island": 1})
        done.set()

    assert _wait_for(a, slow_island) > 3.0, "the wait must have outlived the 1.5 s grace window"
    assert done.is_set()
    # an island that stops making progress (its process runs on) is given up after grace_s, with the cause
    b.heartbeat(99)
    started = time.monotonic()
    with pytest.raises(IslandAborted, match=r"islands \[1\] did not reach 'round1' and showed no progress for 1.5 s"):
        a.gather_objects("round1", {"island": 0})
    assert time.monotonic() - started < 10


def test_a_long_task_in_a_beating_block_counts_as_progress_and_the_beats_stop_after_it():
    coord = Coordinator()
    a = IslandLink(coord.address, 0, 2, run_id="r", grace_s=1, deadline=timedelta(seconds=60))
    b = IslandLink(coord.address, 1, 2, run_id="r", grace_s=1)
    b.alive.settle()  # as after its first round: its beat follows its progress

    def writing_island() -> None:  # 3.5 s of one silent task (a checkpoint write), then it arrives
        with b.beating({"step": 7, "phase": "saving checkpoint"}):
            time.sleep(3.5)
        b.gather_objects("round0", {"island": 1})

    assert _wait_for(a, writing_island) > 3.0, "the wait must have outlived the 1 s grace window"
    assert coord.status(2, "r")[1]["phase"] == "saving checkpoint"
    assert not [th for th in threading.enumerate() if th.name.startswith("island1-heartbeat")]
    # a body that raises stops the beats too: the island is then silent and given up after grace_s
    with pytest.raises(RuntimeError, match="disk full"), b.beating({"step": 8}):
        raise RuntimeError("disk full")
    started = time.monotonic()
    with pytest.raises(IslandAborted, match=r"islands \[1\] did not reach 'round1' and showed no progress"):
        a.gather_objects("round1", {"island": 0})
    assert time.monotonic() - started < 10


def test_the_start_waits_at_most_its_deadline_even_for_a_beating_island():
    coord = Coordinator()
    a = IslandLink(coord.address, 0, 2, run_id="r", grace_s=1, deadline=timedelta(seconds=2))
    b = IslandLink(coord.address, 1, 2, run_id="r", grace_s=1)
    stop = threading.Event()

    def beating() -> None:
        step = 0
        while not stop.is_set():
            b.heartbeat({"step": step})
            step += 1
            time.sleep(0.1)

    t = threading.Thread(target=beating)
    t.start()
    try:
        started = time.monotonic()
        expected = r"islands \[1\] did not reach 'round0' within deadline_s=2 s"
        with pytest.raises(DeadlinePassed, match=expected):
            a.gather_objects("round0", {"island": 0})
        assert 2.0 <= time.monotonic() - started < 10
        # the launcher shows the heartbeat as the island's status, per run
        assert coord.status(2, "r")[1]["step"] >= 0 and coord.status(2, "other") == [None, None]
    finally:
        stop.set()
        t.join(timeout=10)


@pytest.mark.parametrize("sizes", [(10, 0, 7), (10, 7), (0, 5), (1, 0)],
                         ids=["ring", "pair", "pair, one empty", "tiny"])
def test_lanes_all_gather_payloads_of_different_sizes_and_count_bytes(sizes):
    n = len(sizes)
    coord = Coordinator()
    links = [IslandLink(coord.address, i, n, run_id="lanes", lanes=3) for i in range(n)]
    payloads = [torch.arange(k, dtype=torch.uint8) for k in sizes]
    results: list = [None] * n

    def island(i: int) -> None:
        links[i].open_lanes()
        results[i] = links[i].all_gather_bytes(payloads[i])

    threads = [threading.Thread(target=island, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert bool(links[0].lanes.directed) == (n == 2)  # two islands: one group per lane and direction
    for got in results:
        assert [torch.equal(g, p) for g, p in zip(got, payloads)] == [True] * n
    stats = links[0].take_stats()
    assert stats.bytes_sent == sizes[0] * (n - 1) and stats.bytes_received == sum(sizes[1:])
    assert links[0].take_stats().bytes_sent == 0


@pytest.mark.parametrize("groups", [[[0, 1]], [[0, 1], [2, 3]], [[0, 2], [1], [3, 4, 5]]],
                         ids=["pair (directed groups)", "two pairs", "a lone island, a pair, a group of three"])
def test_lanes_swap_payloads_within_each_group_only_and_count_bytes(groups):
    n = sum(len(g) for g in groups)
    coord = Coordinator()
    links = [IslandLink(coord.address, i, n, run_id="swap", lanes=3) for i in range(n)]
    payloads = [torch.arange(3 * i + (i % 2) * 5, dtype=torch.uint8) for i in range(n)]  # island 0's is empty
    results: list = [None] * n
    peers = {i: [j for j in g if j != i] for g in groups for i in g}

    def island(i: int) -> None:
        links[i].open_lanes()
        results[i] = links[i].swap_bytes(payloads[i], peers[i])

    threads = [threading.Thread(target=island, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for i in range(n):
        assert sorted(results[i]) == peers[i]
        assert all(torch.equal(results[i][j], payloads[j]) for j in peers[i]), f"island {i}"
        stats = links[i].take_stats()
        assert stats.bytes_sent == payloads[i].numel() * len(peers[i])
        assert stats.bytes_received == sum(payloads[j].numel() for j in peers[i])
    for link in links:
        link.close()


@pytest.mark.parametrize("announced", [-4, 2**40], ids=["negative", "oversized"])
def test_a_payload_size_no_honest_island_sends_is_refused_before_allocating(announced, caplog):
    """Island 1 announces a size of its payload that is negative, or 1 TiB against a limit of 64
    bytes (what the codec produces for the chunk): island 0 refuses it, naming island 1, without
    allocating (1 TiB would not fit), and island 1's next operation learns that island 0 gave up."""
    coord = Coordinator()
    links = [IslandLink(coord.address, i, 2, run_id="sizes", lanes=2, grace_s=1,
                        deadline=timedelta(seconds=30)) for i in range(2)]
    results: list = [None, None]

    def island(i: int) -> None:
        links[i].open_lanes()
        if i == 1:
            honest = links[1].lanes.sizes
            links[1].lanes.sizes = lambda n: honest(announced)  # what goes out on the lane, not the payload
        try:
            results[i] = links[i].all_gather_bytes(torch.zeros(64, dtype=torch.uint8), limit=64)
        except Exception as err:  # noqa: BLE001 - the outcome is what the test looks at
            results[i] = err
            if i == 0:
                links[0].abort(f"island 0: {err}")

    threads = [threading.Thread(target=island, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert isinstance(results[0], PayloadRefused), results[0]
    assert f"island(s) [1] announced [{announced}] bytes, outside 0..64" in str(results[0])
    assert "refused before allocating" in caplog.text
    assert isinstance(results[1], Exception), "island 1 does not go on as if the exchange happened"
    for link in links:
        link.close()


def test_the_lanes_rendezvous_all_at_once_and_a_second_build_reuses_the_connections():
    """An island opening its lanes publishes every group's address before its peer arrives (one
    group after another, it would publish the first and wait there); a rebuild for another member
    set opens no new store connections and destroys the old set's groups (idle: nothing is inside)."""
    coord = Coordinator()
    links = [IslandLink(coord.address, i, 2, run_id="rdv", lanes=3) for i in range(2)]
    groups = 3 * 3  # two islands: each lane plus one group per direction
    before = coord.store.num_keys()
    first = threading.Thread(target=links[0].open_lanes)
    first.start()
    deadline = time.monotonic() + 30
    while coord.store.num_keys() - before < groups and time.monotonic() < deadline:
        time.sleep(0.05)
    published = coord.store.num_keys() - before
    second = threading.Thread(target=links[1].open_lanes)
    second.start()
    first.join(timeout=60)
    second.join(timeout=60)
    assert published >= groups, f"island 0 published {published} keys before its peer came; {groups} groups"
    assert [len(link.lanes.groups) for link in links] == [3, 3] and all(len(d) == 2 for d in links[0].lanes.directed)
    stores = list(links[0].lanes._stores)
    assert len(stores) == groups and all(s is not None for s in stores)

    got: list = [None, None]

    def rebuild(link: IslandLink) -> None:
        link._build_lanes("again", (0, 1))
        got[link.island] = link.all_gather_bytes(torch.full((5,), link.island, dtype=torch.uint8))

    threads = [threading.Thread(target=rebuild, args=(link,)) for link in links]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [[g.tolist() for g in gathered] for gathered in got] == [[[0] * 5, [1] * 5]] * 2
    assert [s is t for s, t in zip(links[0].lanes._stores, stores)] == [True] * groups
    assert links[0].lanes_key == "again" and links[0].lanes.retired == 0, "the old set's groups were destroyed"


@pytest.mark.parametrize("kwargs, env, needle", [
    ({"num_islands": 2}, {}, r"2 islands need a coordinator address: pass coordinator='HOST:PORT' or set LI_"),
    ({"island": 3, "num_islands": 2, "coordinator": "h:1"}, {}, r"island index 3 is outside \[0, 2\)"),
    ({}, {"LI_ISLAND": "one"}, r"environment variable LI_ISLAND='one' must be an integer"),
])
def test_a_bad_island_identity_names_the_fix(kwargs, env, needle, monkeypatch):
    from lightning_islands.link.coordinator import island_identity

    for key in ("LI_ISLAND", "LI_NUM_ISLANDS", "LI_COORDINATOR", "LI_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=needle):
        island_identity(**kwargs)


def test_the_island_identity_comes_from_the_environment(monkeypatch):
    from lightning_islands.link.coordinator import island_identity

    monkeypatch.setenv("LI_ISLAND", "1")
    monkeypatch.setenv("LI_NUM_ISLANDS", "3")
    monkeypatch.setenv("LI_COORDINATOR", "coord:29400")
    monkeypatch.delenv("LI_RUN_ID", raising=False)
    assert island_identity() == (1, 3, "coord:29400", "islands")
    assert island_identity(island=2, run_id="exp1") == (2, 3, "coord:29400", "exp1")


def test_descriptors_and_threads_stay_bounded_over_100_member_set_changes():
    """Each member-set change builds new lanes (a new store prefix) and moves a payload on them; the
    previous set's groups are destroyed. Groups an abandoned operation is inside are kept until it
    ends (here gloo's 2 s timeout ends it), then destroyed at the next build."""
    import gc
    import os

    from doubles import run_threads

    from lightning_islands.link import liveness
    from lightning_islands.link.lanes import Lanes, rendezvous_keys

    coord = Coordinator()
    connect = liveness.connector("127.0.0.1", coord.port, timedelta(seconds=30))
    lanes = [Lanes(connect, 1, timedelta(seconds=2), None, f"island {i}") for i in range(2)]

    def counts() -> tuple[int, int]:
        gc.collect()  # links earlier tests dropped stop their threads once collected
        return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))

    def change(k: int) -> None:
        run_threads([lambda i=i: lanes[i].build(f"set{k}/", i, 2) for i in range(2)])
        got = run_threads([lambda i=i: lanes[i].all_gather(torch.full((8,), i, dtype=torch.uint8), [8, 8])
                           for i in range(2)])
        assert [t.tolist() for t in got[0]] == [[0] * 8, [1] * 8]

    n0 = coord.store.num_keys()
    change(0)
    keys = rendezvous_keys("set0/", 1, 2)  # what the sweeper deletes once these lanes' round is long over
    assert coord.store.check(keys) and coord.store.num_keys() - n0 == len(keys), "the rendezvous left these keys"
    for key in keys:
        coord.store.delete_key(key)
    assert coord.store.num_keys() == n0
    for k in range(1, 5):  # the store connections are made once and reused
        change(k)
    before = counts()
    for k in range(5, 105):
        change(k)
    after = counts()
    print(f"descriptors {before[0]} -> {after[0]}, threads {before[1]} -> {after[1]} over 100 member-set changes")
    assert after[0] <= before[0] + 8 and after[1] <= before[1] + 8, (before, after)
    # an operation abandoned inside island 0's groups: a receive that island 1 never sends to
    pending = [lanes[0].directed[0][1].recv([torch.empty(8, dtype=torch.uint8)], 1, 0)]
    ended = threading.Event()

    def abandoned() -> None:
        with pytest.raises(RuntimeError):
            pending[0].wait()
        ended.set()

    t = threading.Thread(target=abandoned, daemon=True)
    t.start()
    lanes[0].retire(ended)
    idle = threading.Event()
    idle.set()
    lanes[1].retire(idle)  # island 1 gives its groups up too (nothing is inside them)
    assert lanes[0].retired == 1
    assert ended.wait(60), "gloo's timeout ends the abandoned operation"
    pending.clear()
    change(105)
    assert lanes[0].retired == 0, "destroyed once the operation inside them ended"
    assert counts()[0] <= before[0] + 8, (before, counts())
