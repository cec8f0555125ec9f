"""Authenticated links: what a shared secret lets through and what it stops.

Islands are threads over the in-memory link of ``doubles`` (every wait there has a timeout, so a bug
fails instead of hanging), and once over the real coordinator and gloo lanes on loopback.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
from doubles import Hub, MemoryLink
from test_engine import SPECS, assert_identical, run

from lightning_islands.engine import CanonicalLayout, IslandEngine, IslandSettings
from lightning_islands.engine.settings import compare_fingerprints
from lightning_islands.link import Link
from lightning_islands.link.auth import (
    ENV_SECRET,
    ENV_SECRET_FILE,
    PIECE_BYTES,
    TAG_BYTES,
    AuthenticatedLink,
    AuthenticationError,
    derive_key,
    load_secret,
)

SECRET = b"correct horse battery staple 42"
OTHER = b"another secret of enough bytes"
FIX = "give every island the same secret"


def outcomes(targets: list) -> list[Any]:
    """Run each target in a thread: its result, or the exception it raised (nothing hangs: 60 s)."""
    out: list[Any] = [None] * len(targets)

    def wrap(k: int) -> None:
        try:
            out[k] = targets[k]()
        except Exception as err:  # noqa: BLE001 - returned to the test
            out[k] = err

    threads = [threading.Thread(target=wrap, args=(k,), daemon=True) for k in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "an island hung"
    return out


def wrapped(hub: Hub, secrets: list[bytes | None], cls: list[type] | None = None) -> list:
    """One link per island: AuthenticatedLink over a MemoryLink (of class ``cls[i]``), or the plain
    MemoryLink where the secret is None."""
    links = []
    for i, secret in enumerate(secrets):
        inner = (cls[i] if cls else MemoryLink)(hub, i)
        inner.open_lanes()
        links.append(inner if secret is None else AuthenticatedLink(inner, secret, "run-a", threads=2))
    return links


def payload(island: int, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(island))


def exchange(link, sizes: list[int]) -> dict[str, Any]:
    """What one island sees of a fingerprint, a round header, a gather and two broadcasts."""
    i = link.island
    return {"fingerprint": link.gather_objects("fingerprint", {"codec": "int4", "island": i, "lr": 0.7}),
            "header": link.gather_objects("round3", {"tokens": 100 * (i + 1), "experts": {"0": [1.5, float("inf")]}}),
            "gather": link.all_gather_bytes(payload(i, sizes[i])),
            "broadcast": link.broadcast_bytes(payload(9, 1000) if i == 1 else None, src=1),
            "empty": link.broadcast_bytes(torch.empty(0, dtype=torch.uint8) if i == 0 else None, src=0)}


def assert_same_views(a: dict, b: dict) -> None:
    assert a["fingerprint"] == b["fingerprint"] and a["header"] == b["header"]
    assert all(torch.equal(x, y) for x, y in zip(a["gather"], b["gather"]))
    assert torch.equal(a["broadcast"], b["broadcast"]) and a["empty"].numel() == b["empty"].numel() == 0


# ------------------------------------------------------------------------------------------- round trips
def test_objects_payloads_and_broadcasts_arrive_unchanged():
    sizes = [3 * PIECE_BYTES + 5, 0, 17]  # a tree of four pieces, an empty payload, a small one
    plain = outcomes([lambda link=link: exchange(link, sizes) for link in wrapped(Hub(3), [None] * 3)])
    links = wrapped(Hub(3), [SECRET] * 3)
    authed = outcomes([lambda link=link: exchange(link, sizes) for link in links])
    for a, p in zip(authed, plain):
        assert not isinstance(a, Exception), a
        assert_same_views(a, p)
    assert [t.numel() for t in authed[0]["gather"]] == sizes
    assert authed[0]["header"][1] == {"tokens": 200, "experts": {"0": [1.5, float("inf")]}}
    stats = links[0].take_stats()
    assert stats.bytes_sent == (sizes[0] + TAG_BYTES) * 2 + TAG_BYTES * 2, "the tags are bytes on the link too"
    assert stats.seconds_exchanging > 0, "signing and checking count as exchanging"
    # the whole Link protocol by name, and nothing else of the wrapped link (no __getattr__ forwarding)
    protocol = [n for n in vars(Link) if not n.startswith("_")] + list(Link.__annotations__)
    assert [n for n in protocol if n not in vars(AuthenticatedLink) and n not in ("island", "num_islands")] == []
    assert not hasattr(links[0], "hub") and links[0].link.hub is not None
    assert SECRET.decode() not in repr(links[0])
    for link in links:
        link.close()


# ------------------------------------------------------------------------------------------- tampering
class FlipLink(MemoryLink):
    """Island 1's link, on which one byte of every payload it sends is flipped on the way (``AT``:
    an index into the signed payload, the tag included)."""

    AT = 0

    def all_gather_bytes(self, payload: torch.Tensor, limit: int | None = None) -> list[torch.Tensor]:
        altered = payload.clone()
        altered[self.AT] ^= 0x01
        return super().all_gather_bytes(altered, limit)

    def broadcast_bytes(self, payload: torch.Tensor | None, src: int = 0, limit: int | None = None) -> torch.Tensor:
        if payload is not None:
            payload = payload.clone()
            payload[self.AT] ^= 0x80
        return super().broadcast_bytes(payload, src, limit)


class LastByteLink(FlipLink):
    AT = -1  # the tag's last byte


class HeaderLink(MemoryLink):
    """Island 1's link, on which its round header's token count is raised on the way."""

    def gather_objects(self, key: str, obj: Any) -> list:
        if key.startswith("round"):
            obj = {**obj, "json": obj["json"].replace('"tokens": 200', '"tokens": 20000')}
        return super().gather_objects(key, obj)


@pytest.mark.parametrize("cls", [FlipLink, LastByteLink])
def test_a_payload_altered_on_the_way_is_rejected_naming_its_island(cls, caplog):
    links = wrapped(Hub(3), [SECRET] * 3, [MemoryLink, cls, MemoryLink])
    got = outcomes([lambda link=link: link.all_gather_bytes(payload(link.island, 5000)) for link in links])
    for i in (0, 2):
        assert isinstance(got[i], AuthenticationError), got[i]
        message = str(got[i])
        assert "island 1's payload of all_gather_bytes call 1 (5000 bytes) does not match its tag" in message
        assert "altered on the way" in message and FIX in message
    assert not isinstance(got[1], Exception), "island 1 received untouched payloads"
    assert "island 1's payload" in caplog.text, "the rejection is in the log"


def test_a_broadcast_altered_on_the_way_is_rejected():
    links = wrapped(Hub(2), [SECRET] * 2, [MemoryLink, FlipLink])
    got = outcomes([lambda link=link: link.broadcast_bytes(payload(1, 100) if link.island == 1 else None, src=1)
                    for link in links])
    assert isinstance(got[0], AuthenticationError)
    assert "island 1's payload of broadcast_bytes call 1 from island 1 (100 bytes)" in str(got[0])


def test_a_round_header_altered_on_the_way_is_rejected():
    links = wrapped(Hub(2), [SECRET] * 2, [MemoryLink, HeaderLink])
    got = outcomes([lambda link=link: link.gather_objects("round7", {"tokens": 100 * (link.island + 1)})
                    for link in links])
    for err in got:  # island 1 checks its own header too: the store it went through is not trusted
        assert isinstance(err, AuthenticationError), err
        assert "island 1's round header 'round7' does not match its MAC" in str(err)


class ReplayLink(MemoryLink):
    """Island 1's link, on which its first payload is sent again in place of the second."""

    def all_gather_bytes(self, payload: torch.Tensor, limit: int | None = None) -> list[torch.Tensor]:
        self.first = getattr(self, "first", payload.clone())
        return super().all_gather_bytes(self.first, limit)


def test_a_replayed_payload_is_rejected_by_its_sequence_number():
    links = wrapped(Hub(2), [SECRET] * 2, [MemoryLink, ReplayLink])
    outcomes([lambda link=link: link.all_gather_bytes(payload(link.island, 64)) for link in links])
    got = outcomes([lambda link=link: link.all_gather_bytes(payload(link.island + 5, 64)) for link in links])
    assert isinstance(got[0], AuthenticationError) and "all_gather_bytes call 2" in str(got[0])


def test_a_payload_of_another_run_does_not_verify():
    hub = Hub(2)
    a = AuthenticatedLink(MemoryLink(hub, 0), SECRET, "run-a")
    b = AuthenticatedLink(MemoryLink(hub, 1), SECRET, "run-b")  # same secret, another run id
    got = outcomes([lambda: a.gather_objects("round1", {"x": 1}), lambda: b.gather_objects("round1", {"x": 1})])
    assert all(isinstance(e, AuthenticationError) for e in got)


def test_restarted_sequences_agree_only_when_every_island_restarts():
    links = wrapped(Hub(2), [SECRET] * 2)
    outcomes([lambda link=link: link.all_gather_bytes(payload(link.island, 8)) for link in links])
    for link in links:
        link.restart_sequence("members-5")
    got = outcomes([lambda link=link: link.all_gather_bytes(payload(link.island, 8)) for link in links])
    assert all(isinstance(g, list) for g in got), got
    links[1].restart_sequence("members-6")  # island 1 alone
    got = outcomes([lambda link=link: link.all_gather_bytes(payload(link.island, 8)) for link in links])
    assert "all_gather_bytes call 2 of epoch 'members-5'" in str(got[0])


# ------------------------------------------------------------------------------------------- wrong or no secret
def test_an_island_with_the_wrong_secret_fails_on_every_side():
    links = wrapped(Hub(3), [SECRET, SECRET, OTHER])
    got = outcomes([lambda link=link: link.gather_objects("fingerprint", {"codec": "int4"}) for link in links])
    for i in (0, 1):
        assert isinstance(got[i], AuthenticationError)
        assert "island 2's object 'fingerprint' does not match its MAC" in str(got[i]) and FIX in str(got[i])
    assert isinstance(got[2], AuthenticationError)
    assert "island 0's object 'fingerprint'" in str(got[2]) and "island 1's object 'fingerprint'" in str(got[2])
    assert SECRET.decode() not in str(got[0]) and OTHER.decode() not in str(got[2])


def test_an_island_without_a_secret_fails_on_both_sides():
    links = wrapped(Hub(2), [SECRET, None])
    got = outcomes([lambda link=link: link.gather_objects("fingerprint", {"codec": "int4", "auth": False})
                    for link in links])
    assert isinstance(got[0], AuthenticationError)
    assert "island 1 sent object 'fingerprint' without authentication: it runs without a secret" in str(got[0])
    # island 1 sees island 0's envelope where a fingerprint should be: the comparison names it
    assert "island 1 has auth=False but island 0 has auth='hmac-sha256" in compare_fingerprints(got[1])


@pytest.mark.parametrize("size", [5, 500])
def test_a_payload_without_a_tag_is_rejected(size):
    links = wrapped(Hub(2), [SECRET, None])
    got = outcomes([lambda link=link: link.all_gather_bytes(payload(link.island, size)) for link in links])
    expected = "fewer than its 32-byte tag" if size < TAG_BYTES else "does not match its tag"
    assert isinstance(got[0], AuthenticationError) and expected in str(got[0])


def _meet(i: int, link) -> None:
    settings = IslandSettings(sync_every=3)
    layout = CanonicalLayout(SPECS)
    engine = IslandEngine(settings, layout, i, 2, torch.device("cpu"), torch.device("cpu"))
    engine.meet(lambda: link, settings.fingerprint(layout, False, "cpu"))


def test_the_engine_stops_both_islands_when_one_has_the_wrong_secret():
    links = wrapped(Hub(2), [SECRET, OTHER])
    got = outcomes([lambda i=i: _meet(i, links[i]) for i in range(2)])
    for err in got:  # each finds the other's MAC wrong, or hears of it first from the other's abort
        assert isinstance(err, RuntimeError), err
        assert "AuthenticationError: island" in str(err) and "'fingerprint' does not match its MAC" in str(err)


# ------------------------------------------------------------------------------------------- the real link
def test_a_star_of_swaps_checks_out_under_the_secret():
    """A repair's source swaps with every island it repairs, each of them only with the source, an
    island in step with nobody: every payload arrives and checks out."""
    hub = Hub(4)
    links = [AuthenticatedLink(MemoryLink(hub, i), SECRET, "star") for i in range(4)]
    for link in links:
        link.open_lanes()
    peers = {0: [2, 3], 1: [], 2: [0], 3: [0]}
    payload = {i: torch.full((5 + i,), i, dtype=torch.uint8) for i in range(4)}
    got = outcomes([lambda i=i: links[i].swap_bytes(payload[i], peers[i]) for i in range(4)])
    assert not any(isinstance(g, Exception) for g in got), got
    for i in range(4):
        assert sorted(got[i]) == peers[i] and all(torch.equal(got[i][p], payload[p]) for p in peers[i])


def test_the_real_link_over_loopback_with_a_secret_gives_the_same_bits():
    """Two islands' engines over the coordinator and gloo lanes, each link authenticated: the same
    global states as the plain in-memory run (the initial state is broadcast: islands start apart)."""
    from test_engine import LOOPBACK_PLAN, loopback_island

    from lightning_islands.link.coordinator import Coordinator
    from lightning_islands.link.island_link import IslandLink

    coordinator = Coordinator()
    links = [AuthenticatedLink(IslandLink(coordinator.address, i, 2, run_id="auth", lanes=2), SECRET, "auth")
             for i in range(2)]
    got = outcomes([lambda i=i: loopback_island(i, lambda k: links[k]) for i in range(2)])
    links[0].heartbeat({"step": 1})  # forwarded to the IslandLink
    for link in links:
        link.close()
    assert not any(isinstance(g, Exception) for g in got), got
    assert all(torch.equal(a, b) for a, b in zip(*got))
    assert all(torch.equal(a, b) for a, b in zip(got[0], assert_identical(run(LOOPBACK_PLAN))))
    assert coordinator.status(2, "auth")[0] == {"step": 1}


def test_the_real_link_rejects_the_wrong_secret_on_both_sides():
    from lightning_islands.link.coordinator import Coordinator
    from lightning_islands.link.island_link import IslandLink

    coordinator = Coordinator()
    links = [AuthenticatedLink(IslandLink(coordinator.address, i, 2, run_id="wrong"), s, "wrong")
             for i, s in enumerate([SECRET, OTHER])]
    got = outcomes([lambda link=link: link.gather_objects("fingerprint", {"codec": "int4"}) for link in links])
    assert "island 1's object 'fingerprint' does not match its MAC" in str(got[0])
    assert "island 0's object 'fingerprint' does not match its MAC" in str(got[1])


# ------------------------------------------------------------------------------------------- the secret
@pytest.fixture
def no_secret_env(monkeypatch):
    monkeypatch.delenv(ENV_SECRET, raising=False)
    monkeypatch.delenv(ENV_SECRET_FILE, raising=False)
    return monkeypatch


def _secret_file(tmp_path, text: bytes, mode: int = 0o600):
    path = tmp_path / "secret"
    path.write_bytes(text)
    os.chmod(path, mode)
    return path


def test_the_secret_comes_from_a_file_then_the_environment(no_secret_env, tmp_path):
    assert load_secret() is None
    no_secret_env.setenv(ENV_SECRET, " " + SECRET.decode() + "\n")
    assert load_secret() == SECRET
    path = _secret_file(tmp_path, OTHER + b"\n")
    assert load_secret(path) == OTHER, "a file given wins over LI_SECRET"
    no_secret_env.setenv(ENV_SECRET_FILE, str(path))
    assert load_secret() == OTHER


def test_bad_secrets_are_refused_with_the_file_and_the_fix(no_secret_env, tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=rf"secret file {missing} does not exist.*chmod 600"):
        load_secret(missing)
    empty = _secret_file(tmp_path, b"\n")
    with pytest.raises(ValueError, match=rf"secret file {empty} is empty"):
        load_secret(empty)
    for mode in (0o644, 0o640, 0o604, 0o620):
        path = _secret_file(tmp_path, SECRET, mode)
        with pytest.raises(PermissionError, match=rf"secret file {path} has mode {mode:o}.*`chmod 600 {path}`"):
            load_secret(path)
    short = _secret_file(tmp_path, b"hunter2")
    with pytest.raises(ValueError, match="7 bytes, fewer than 16.*secrets.token_hex") as err:
        load_secret(short)
    assert "hunter2" not in str(err.value), "the secret never appears in a message"
    no_secret_env.setenv(ENV_SECRET, "  ")
    with pytest.raises(ValueError, match="LI_SECRET is set but empty.*unset it"):
        load_secret()


# ------------------------------------------------------------------------------------------- sealed decisions
def _sealed_links(run_id: str, n: int = 2) -> tuple[Any, list]:
    from datetime import timedelta

    from lightning_islands.link.coordinator import Coordinator
    from lightning_islands.link.island_link import IslandLink

    coordinator = Coordinator()
    links = [IslandLink(coordinator.address, i, n, run_id=run_id, lanes=1, grace_s=1.0, secret=SECRET,
                        deadline=timedelta(seconds=30)) for i in range(n)]
    run_threads_ok([link.open_lanes for link in links])
    return coordinator, links


def _landed(store: Any, key: str) -> None:
    """Wait until the coordinator applied this client's last write to ``key``: a TCPStore ``set``
    gets no reply, so another client's read may reach the coordinator first; a read on the writer's
    own connection is answered only after its earlier requests."""
    store.get(key)


def run_threads_ok(fns: list) -> list:
    got = outcomes(fns)
    assert not any(isinstance(g, Exception) for g in got), got
    return got


@pytest.mark.parametrize("forged, key, step", [
    ("members", "f/round0/a0/members", "meet"),
    ("outcome", "f/round0/a0/outcome", "settle"),
    ("ended", "f/ended", "meet"),
    ("join", "f/join/1", "meet"),
    ("abort", "f/abort/1", "meet"),
    ("header", "f/round0/a0/h/1", "meet"),
    ("done", "f/round0/a0/done/1", "settle0"),
], ids=["members", "outcome", "ended", "join", "abort", "header", "done"])
def test_a_forged_decision_or_report_is_refused_and_named_never_acted_on(forged, key, step, caplog):
    """With a secret, a value written into the coordinator by a process without it (what anyone who
    reaches the coordinator's port can do) is refused, naming its key, by the island that reads it:
    the island ends with AuthenticationError instead of acting on a forged member set, outcome, end
    of the run, join request, abort report, header or "done" mark (island 1, not there yet, writes
    none of its own)."""
    from lightning_islands.link.membership import Decision

    coordinator, links = _sealed_links("f")
    values = {"members": Decision(0, 0, (0,), "round0/a0").to_json(), "outcome": "ok", "ended": "0",
              "join": '{"from": 0, "inc": 1}', "abort": "island 1 failed", "header": "{}", "done": "1"}
    if step.startswith("settle"):
        run_threads_ok([lambda link=link: link.meet_round(0, {}) for link in links])
    coordinator.store.set(key, values[forged])  # the forger, without the secret
    if step == "settle":
        got = outcomes([lambda link=link: link.settle_round() for link in links])
    elif step == "settle0":  # island 1 never says it finished: only the forged mark does
        got = outcomes([lambda: links[0].settle_round()])
    else:  # island 0 meets round 0 and reads what is there while it waits for island 1
        got = outcomes([lambda: links[0].meet_round(0, {})])
    refused = [g for g in got if isinstance(g, AuthenticationError)]
    assert refused, f"the forged {forged} was acted on: {got}"
    assert f"under {key!r}" in str(refused[0]) and "it carries no MAC" in str(refused[0])
    assert f"under {key!r}" in caplog.text
    for link in links:
        link.close()


def test_a_header_replayed_from_another_round_is_refused_and_named(caplog):
    """Island 1's sealed round-0 header copied to its round-1 key (before island 1 writes its own)
    does not verify there: island 0 refuses it, naming the key, instead of merging with it."""
    coordinator, links = _sealed_links("hr")
    run_threads_ok([lambda link=link: (link.meet_round(0, {"tokens": 1}), link.settle_round()) for link in links])
    store = coordinator.store
    store.set("hr/round1/a0/h/1", store.get("hr/round0/a0/h/1"))
    got = outcomes([lambda: links[0].meet_round(1, {"tokens": 1})])
    assert isinstance(got[0], AuthenticationError), got
    assert "under 'hr/round1/a0/h/1'" in str(got[0]) and "replayed" in str(got[0])
    assert "under 'hr/round1/a0/h/1'" in caplog.text
    for link in links:
        link.close()


def test_values_of_an_islands_earlier_life_replayed_at_their_keys_are_not_acted_on(caplog):
    """With a secret, a sealed value can still be replayed at the very key it was written under.
    Island 1's beat, failure report and join request of its first life (incarnation 0), recorded,
    are replayed after it restarted (its beats now read incarnation 1): island 0 does not count the
    old beat as progress nor as a restart, and ignores the old report and join request, logging
    each; a report of its current life is acted on."""
    coordinator, links = _sealed_links("life")
    store, m0, one = coordinator.store, links[0].membership, links[1]
    alive, abort, join = m0.alive_key(1), "life/abort/1", m0._k("join/1")
    m0._watch.seen.pop(1, None)  # a scan of the start-up (on a loaded machine) may have seen island 1 already
    assert m0._silent([1], 0.0)[1] == 0.0
    one.abort("island 1: RuntimeError: out of memory")  # its first life fails, asks back, and restarts
    one.membership.request_join(0)
    _landed(one.store, abort)
    _landed(one.store, join)
    recorded = {key: store.get(key) for key in (alive, abort, join)}
    one.alive.stop()
    one.alive._thread.join(timeout=30)  # its last beat is written before the restarted life's
    assert not one.alive._thread.is_alive()
    one.membership.incarnation = 1
    store.delete_key(abort)  # what a restarted island does first (IslandLink.rejoin)
    store.delete_key(join)
    one.store.set(alive, "1:1")
    _landed(one.store, alive)
    assert m0._silent([1], 1.0)[1] == 0.0 and m0._beat_incarnation(1) == 1
    for key, raw in recorded.items():  # whoever reaches the coordinator replays them
        store.set(key, raw)
        _landed(store, key)
    assert m0._silent([1], 5.0)[1] == 4.0, "the replayed beat is not progress"
    assert m0._beat_incarnation(1) == 1, "nor a restart"
    assert links[0]._aborted(1) is None and 1 not in m0.joiners(0)
    assert "ignores island 1's failure report of its incarnation 0" in caplog.text
    assert "ignores island 1's join request of its incarnation 0" in caplog.text
    one.abort("island 1: RuntimeError: out of memory again")  # its current life's report counts
    _landed(one.store, abort)
    assert links[0]._aborted(1) == "island 1: RuntimeError: out of memory again"
    for link in links:
        link.close()


def test_a_decision_replayed_from_another_round_or_attempt_does_not_verify():
    """A value sealed for one key (round 0's member set) copied to another (round 1's, or another
    attempt's) does not verify: the MAC binds the key, which names the run, round and attempt."""
    coordinator, links = _sealed_links("r")
    run_threads_ok([lambda link=link: (link.meet_round(0, {}), link.settle_round()) for link in links])
    store = coordinator.store
    for target in ("r/round1/a0/members", "r/round0/a1/members"):
        store.set(target, store.get("r/round0/a0/members"))
    got = outcomes([lambda link=link: link.meet_round(1, {}) for link in links])
    refused = [g for g in got if isinstance(g, AuthenticationError)]
    assert refused and "under 'r/round1/a0/members'" in str(refused[0]), got
    assert "does not match its MAC" in str(refused[0]) and "replayed" in str(refused[0])
    for link in links:
        link.close()


def test_sealed_values_round_trip_and_only_absent_values_are_compared():
    from lightning_islands.link.coordinator import Coordinator
    from lightning_islands.link.sealed import SealedStore

    store = SealedStore(Coordinator().store, derive_key(SECRET, "s"), 0)
    store.set("s/a", "1")
    assert store.get("s/a") == b"1" and store.multi_get(["s/a"]) == [b"1"]
    assert store.compare_set("s/b", "", "ok") == b"ok" and store.compare_set("s/b", "", "fail") == b"ok"
    with pytest.raises(ValueError, match="only against an absent value"):
        store.compare_set("s/b", "ok", "fail")
    other = SealedStore(store.store, derive_key(OTHER, "s"), 1)
    with pytest.raises(AuthenticationError, match="does not match its MAC: it was written with another secret"):
        other.get("s/a")
