"""Who talks to whom across islands, and how the bytes move.

A coordinator is a c10d ``TCPStore`` server that outlives any island. Each island's leader (its
global rank 0) connects to it and builds ``lanes``: ProcessGroupGloo groups on the same store, one
TCP stream each, over which payloads are all-gathered in parallel chunks. Nothing here knows about
Lightning, parameters or codecs; it moves uint8 tensors and small JSON objects and counts what it
moved.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_islands.membership import START_LANES, Decision, LateForRound, Membership, RoundLost, get_if_set

ENV_ISLAND = "LI_ISLAND"
ENV_NUM_ISLANDS = "LI_NUM_ISLANDS"
ENV_COORDINATOR = "LI_COORDINATOR"
ENV_RUN_ID = "LI_RUN_ID"
# The network interface the lanes bind to (the launcher's shaped link sets it to the island's veth);
# unset, they use gloo's default device (GLOO_SOCKET_IFNAME, else this host's name).
ENV_LINK_IFNAME = "LI_LINK_IFNAME"
# How many times this island was restarted (torch.distributed.run sets it; 0: the first start).
ENV_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
# How often an island's liveness beat changes while its link is open.
BEAT_S = 0.25


_BEATING: weakref.WeakSet = weakref.WeakSet()  # links whose liveness thread runs


@atexit.register
def _stop_beats() -> None:
    """Stop every liveness thread before the interpreter finalizes (a thread inside the store's C++
    code at that moment aborts the process)."""
    for link in list(_BEATING):
        link._stop_alive()


def restart_count() -> int:
    """This island's start count: 0 the first time, then 1, 2, ... after each restart."""
    return _env_int(ENV_RESTART_COUNT) or 0


def parse_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` (the coordinator address) into its parts, with a clear error."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"coordinator address {address!r} is not of the form HOST:PORT; pass e.g. "
            f"coordinator='127.0.0.1:29400' or set {ENV_COORDINATOR}"
        )
    return host, int(port)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError as err:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from err


def island_identity(island: int | None = None, num_islands: int | None = None, coordinator: str | None = None,
                    run_id: str | None = None) -> tuple[int, int, str | None, str]:
    """``(island, num_islands, coordinator, run_id)``: each argument, else from the environment
    (``LI_ISLAND``, ``LI_NUM_ISLANDS``, ``LI_COORDINATOR``, ``LI_RUN_ID``), else island 0 of 1, no
    coordinator, run id ``"islands"``. Raises a ValueError naming the fix for an index out of range
    or several islands without a coordinator."""
    island = island if island is not None else (_env_int(ENV_ISLAND) or 0)
    num_islands = num_islands if num_islands is not None else (_env_int(ENV_NUM_ISLANDS) or 1)
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    if num_islands > 1 and not coordinator:
        raise ValueError(f"{num_islands} islands need a coordinator address: pass coordinator='HOST:PORT' or set "
                         f"{ENV_COORDINATOR} (`lightning-islands run` sets it for you)")
    if not 0 <= island < num_islands:
        raise ValueError(f"island index {island} is outside [0, {num_islands})")
    return island, num_islands, coordinator, run_id or os.environ.get(ENV_RUN_ID) or "islands"


def _status_key(run_id: str, island: int) -> str:
    """Where an island's status (its heartbeat, also shown by the launcher) lives in the store."""
    return f"{run_id}/status/{island}"


class Coordinator:
    """A standalone c10d TCPStore server that holds membership and rounds for every island.

    Keep the object alive for as long as islands train; ``port=0`` picks a free port.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60))
        self.host = host
        self.port = self.store.port

    @property
    def address(self) -> str:
        """``host:port`` to hand to islands."""
        return f"{self.host}:{self.port}"

    def status(self, num_islands: int, run_id: str) -> list[dict | None]:
        """The latest status each island of run ``run_id`` published (``None`` where none yet)."""
        raw = [get_if_set(self.store, _status_key(run_id, i)) for i in range(num_islands)]
        return [json.loads(r) if r is not None else None for r in raw]


@dataclass
class LinkStats:
    """Bytes and seconds moved by one :class:`IslandLink` since the last :meth:`IslandLink.take_stats`."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds_exchanging: float = 0.0
    seconds_waiting: float = 0.0


class IslandAborted(RuntimeError):
    """Another island reported a failure (or never arrived) while this one waited for it."""


class CoordinatorLost(ConnectionError):
    """The coordinator stopped answering: the run cannot go on (restart it from the last checkpoints)."""


class IslandLink:
    """The leader's connection to the other islands: a store client plus ``lanes`` gloo groups.

    Joining claims the island index under ``run_id`` (a second claim fails: a duplicate island index
    or a reused run id). Small objects go through the store first (fingerprints); :meth:`open_lanes`
    then builds the gloo groups, so a mismatch is reported before anything can hang in them.

    Args:
        address: coordinator ``host:port``.
        island: this island's index in ``[0, num_islands)``.
        num_islands: how many islands take part.
        run_id: namespace for this run's keys in the store (several runs may share a coordinator).
        lanes: parallel TCP streams per island pair; payloads are split across them.
        timeout: how long a waiting island tolerates silence from a missing one: an island that
            keeps sending heartbeats (:meth:`heartbeat`, once per step) is slow, not lost, and is
            waited for; one that is silent this long fails the wait.
        max_wait: the longest one wait may last even while the missing islands keep beating
            (``None``: no limit).
        interface: the network interface the lanes bind to (``None``: ``LI_LINK_IFNAME``, else
            gloo's default device). Only the lanes use it: the island's own process group keeps
            its own device.
        min_islands: the fewest islands a round may go on with (:mod:`lightning_islands.membership`).
        grace_s: how long a round waits for an island that shows no sign of life (a number, or a
            callable asked each time); ``None``: ``timeout``.
        incarnation: this island's start count (a restarted island claims its index anew);
            ``None``: from ``TORCHELASTIC_RESTART_COUNT``.
    """

    def __init__(
        self,
        address: str,
        island: int,
        num_islands: int,
        run_id: str = "run",
        lanes: int = 2,
        timeout: timedelta = timedelta(minutes=10),
        max_wait: timedelta | None = None,
        interface: str | None = None,
        min_islands: int = 1,
        grace_s: float | Callable[[], float] | None = None,
        incarnation: int | None = None,
    ) -> None:
        if not 0 <= island < num_islands:
            raise ValueError(f"island index {island} is outside [0, {num_islands}); check {ENV_ISLAND}")
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        host, port = parse_address(address)
        self._address = (host, port)
        self.island = island
        self.num_islands = num_islands
        self.run_id = run_id
        self.timeout = timeout
        self.max_wait = max_wait
        try:
            self.store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        except Exception as err:  # noqa: BLE001 - re-raised with the cause and the fix
            raise ConnectionError(
                f"island {island} could not reach the coordinator at {address} ({err}); start one with "
                "`lightning-islands coordinator --port PORT` or let `lightning-islands run` start it"
            ) from err
        self.incarnation = restart_count() if incarnation is None else incarnation
        claims = self.store.add(f"{run_id}/joined/{island}/{self.incarnation}", 1)
        if claims > 1:
            raise RuntimeError(
                f"island {island} already joined run {run_id!r} on the coordinator at {address}: either two "
                f"islands were given the same index ({ENV_ISLAND}) or the run id is reused; give every launch "
                f"a fresh {ENV_RUN_ID}"
            )
        self.n_lanes = lanes
        self.interface = interface or os.environ.get(ENV_LINK_IFNAME) or None
        self.lanes: list = []
        self.directed: list = []
        self.present: tuple[int, ...] = tuple(range(num_islands))  # the islands the lanes join
        self._lanes_key: str | None = None
        # lanes of earlier member sets stay referenced: dropping a gloo group whose peer died may abort
        self._retired: list = []
        self._lane_stores: list[dist.TCPStore | None] = []  # one store connection per lane group, reused
        self.decision: Decision | None = None
        self.membership = Membership(self.store, run_id, island, num_islands, min_islands,
                                     timeout.total_seconds() if grace_s is None else grace_s,
                                     None if max_wait is None else max_wait.total_seconds(), self._aborted,
                                     self.incarnation)
        self.stats = LinkStats()
        self._alive_stop = threading.Event()
        self._alive = threading.Thread(target=self._beat_alive, name=f"island{island}-alive", daemon=True)
        self._alive.start()
        _BEATING.add(self)

    def _stop_alive(self) -> None:
        self._alive_stop.set()
        self._alive.join(timeout=5.0)

    def _beat_alive(self) -> None:
        """Change this island's liveness beat every ``BEAT_S`` while the link is open (own connection)."""
        try:
            store = dist.TCPStore(*self._address, is_master=False, timeout=self.timeout)
        except Exception:  # noqa: BLE001 - without beats the island only looks silent
            return
        key, count = self.membership.alive_key(self.island), 0
        while not self._alive_stop.is_set():
            count += 1
            try:
                store.set(key, f"{self.incarnation}:{count}")
            except Exception:  # noqa: BLE001 - the coordinator is gone: the link's own calls will say so
                return
            self._alive_stop.wait(BEAT_S)

    def _aborted(self, island: int) -> str | None:
        """Island ``island``'s failure report, or ``None``."""
        raw = get_if_set(self.store, f"{self.run_id}/abort/{island}")
        return None if raw is None else raw.decode(errors="replace")

    def open_lanes(self) -> None:
        """Build the gloo groups between every island (every island must call this after the
        fingerprint check); the rounds rebuild them whenever their member set changes.

        Between two islands each lane is two groups more, one per direction (``directed[k][i]``
        carries what island ``i`` sends): one gloo connection that carries both directions at once
        moved only about half the link's rate each way on a shaped link (docs/BENCHMARKS.md, lanes),
        two of them 0.95 each way. With more islands the ring all-gather sends one way per connection.
        """
        self._build_lanes(START_LANES, tuple(range(self.num_islands)))

    def _build_lanes(self, key: str, present: tuple[int, ...]) -> None:
        if self.lanes:
            self._retired.append((self.lanes, self.directed))
        self.lanes, self.directed, self.present, self._lanes_key = [], [], present, key
        if len(present) < 2:
            return
        rank, size = present.index(self.island), len(present)
        prefixes = [f"lane{k}" for k in range(self.n_lanes)]
        if size == 2:
            prefixes += [f"lane{k}/from{i}" for k in range(self.n_lanes) for i in range(2)]
        groups = self._rendezvous([(f"{self.run_id}/{key}/{p}/", rank, size) for p in prefixes])
        self.lanes = groups[:self.n_lanes]
        self.directed = [groups[self.n_lanes + 2 * k:self.n_lanes + 2 * k + 2] for k in range(self.n_lanes)] \
            if size == 2 else []

    def _rendezvous(self, specs: Sequence[tuple[str, int, int]]) -> list:
        """Build one gloo group per ``(store prefix, rank, size)``, all at once.

        Each group's rendezvous waits for its peers through the store, a few round trips to the
        coordinator: one after another they cost 3.1 s at 100 ms for two lanes between two islands,
        11.4 s for eight; at once, 0.9 s for either (docs/BENCHMARKS.md, lanes). Each runs in its
        own thread on its own store connection (a store connection serves one request at a time, so
        a rendezvous waiting for a peer would hold up the others on a shared one). The connections
        are kept for the next rebuild.
        """
        options = [self._lane_options() for _ in specs]  # a bad interface fails here, before any thread
        self._lane_stores += [None] * (len(specs) - len(self._lane_stores))  # connected on first use
        built: list = [None] * len(specs)

        def build(k: int) -> None:
            try:
                if self._lane_stores[k] is None:
                    self._lane_stores[k] = dist.TCPStore(*self._address, is_master=False, timeout=self.timeout)
                prefix, rank, size = specs[k]
                built[k] = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self._lane_stores[k]), rank, size,
                                                 options[k])
            except Exception as err:  # noqa: BLE001 - raised below, in the caller's thread
                built[k] = err

        threads = [threading.Thread(target=build, args=(k,), name=f"island{self.island}-lane{k}", daemon=True)
                   for k in range(len(specs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [g for g in built if isinstance(g, Exception)]
        if failed:
            raise RuntimeError(str(failed[0])) from failed[0]
        return built

    @property
    def lanes_key(self) -> str | None:
        """The key the current lanes were built under (it changes with the member set)."""
        return self._lanes_key

    # -- rounds: who takes part ------------------------------------------------------------------
    def meet_round(self, round_: int, header: dict) -> list[dict | None]:
        """Publish this island's header of round ``round_`` and return every island's, in island
        order (``None``: not present this round). The lanes are rebuilt when the member set changed.

        Raises :class:`~lightning_islands.membership.LateForRound` (after asking to rejoin) when the
        round went on without this island, and :class:`~lightning_islands.membership.QuorumLost`.
        """
        try:
            decision, headers = self.membership.decide(round_, header)
        except LateForRound:
            self.membership.request_join(round_ + 1)
            raise
        except dist.DistNetworkError as err:
            raise self._coordinator_lost(err) from err
        if decision.lanes != self._lanes_key:
            try:
                self._build_lanes(decision.lanes, decision.present)
            except RuntimeError as err:
                self.membership.retry(decision)
                raise RoundLost(f"round {round_}: the lanes to islands {list(decision.present)} could not be "
                                f"built ({err})") from err
        self.decision = decision
        return headers

    def settle_round(self) -> None:
        """This island finished the round's exchange: wait until every member did (the round
        counts), or raise :class:`~lightning_islands.membership.RoundLost` (run it again)."""
        if self.decision is not None:
            try:
                self.membership.settle(self.decision)
            except dist.DistNetworkError as err:
                raise self._coordinator_lost(err) from err

    def end_run(self, round_: int) -> None:
        """The islands agreed that round ``round_`` is the last: an island still rejoining stops."""
        self.membership.end(round_)

    def rejoin(self, timeout_s: float) -> int:
        """Ask the live islands to take this (restarted) island back; returns the round they take it
        into (the caller then runs that round as a joiner)."""
        with suppress(Exception):
            self.store.delete_key(f"{self.run_id}/abort/{self.island}")  # a report of this island's earlier life
        try:
            self.membership.request_join()
            return self.membership.await_inclusion(timeout_s).round
        except dist.DistNetworkError as err:
            raise self._coordinator_lost(err) from err

    def membership_changes(self) -> list[str]:
        """The member-set changes seen since the last call (for the log)."""
        changes, self.membership.changes = self.membership.changes, []
        return changes

    def _coordinator_lost(self, err: Exception) -> CoordinatorLost:
        host, port = self._address
        return CoordinatorLost(
            f"island {self.island} lost the coordinator at {host}:{port} ({err}); the run cannot go on without it "
            "(it holds the membership and every round's agreement). Keep the coordinator running for the whole "
            "run; restart the run from the islands' last checkpoints (resume=...)")

    def _lost(self, what: str, err: Exception) -> RoundLost:
        """A lane failed mid-round: the attempt is marked failed, the round runs again."""
        if self.decision is not None:
            self.membership.retry(self.decision)
        return RoundLost(f"island {self.island} lost a peer during {what} ({err}); the round runs again without it")

    def _lane_options(self) -> dist.ProcessGroupGloo._Options | timedelta:
        """A lane's gloo options: bound to :attr:`interface` when one is set, else just the timeout
        (gloo's default device)."""
        if not self.interface:
            return self.timeout
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = self.timeout
        try:
            opts._devices = [dist.ProcessGroupGloo.create_device(interface=self.interface)]
        except RuntimeError as err:
            raise RuntimeError(f"island {self.island} cannot bind its lanes to interface {self.interface!r} "
                               f"({err}); fix or unset {ENV_LINK_IFNAME}") from err
        return opts

    def abort(self, message: str) -> None:
        """Tell the other islands that this one failed, so they stop waiting for it with a clear error."""
        self.store.set(f"{self.run_id}/abort/{self.island}", message[:2000])

    # -- small objects through the store -------------------------------------------------------
    def publish(self, key: str, obj: object) -> None:
        """Set ``key`` (namespaced by run) to ``obj`` as JSON."""
        self.store.set(f"{self.run_id}/{key}", json.dumps(obj))

    def heartbeat(self, status: object) -> None:
        """Publish this island's status (shown by the launcher); it tells waiting islands that this
        one is alive, so it must change as the island advances (e.g. carry a counter)."""
        self.store.set(_status_key(self.run_id, self.island), json.dumps(status))

    @contextmanager
    def beating(self, status: dict, period: float | None = None) -> Iterator[None]:
        """Keep this island's heartbeat going from a background thread while the body runs.

        For work that takes long and cannot beat by itself (writing a checkpoint): the other islands
        see ``status`` with a changing ``"beat"`` every ``period`` seconds (default: a quarter of
        ``timeout``, at most 1 s) and keep waiting for this island instead of giving it up after
        ``timeout``. The thread has its own connection to the coordinator, and it stops when the body
        ends, also by an exception: a failed or hung island stops beating only if the body ends, so
        ``max_wait`` is the bound for a body that hangs. Leaving the block waits at most a few
        seconds for the thread (a connection attempt still under way is left to end by itself: it
        sends nothing once the block has ended).
        """
        period = min(1.0, self.timeout.total_seconds() / 4) if period is None else period
        stop = threading.Event()

        def beat() -> None:
            try:  # best effort: without beats the island only looks silent
                store = dist.TCPStore(*self._address, is_master=False, timeout=self.timeout)
            except Exception:  # noqa: BLE001
                return
            count = 0
            while not stop.wait(period):
                count += 1
                now = {**status, "beat": f"background {count}"}
                with suppress(Exception):  # one failed beat does not end the others
                    store.set(_status_key(self.run_id, self.island), json.dumps(now))

        thread = threading.Thread(target=beat, name=f"island{self.island}-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=max(5.0, 2 * period))

    def _heartbeats(self, islands: Sequence[int]) -> dict[int, bytes | None]:
        return {i: get_if_set(self.store, _status_key(self.run_id, i)) for i in islands}

    def _check_aborts(self) -> None:
        for i in range(self.num_islands):
            report = self._aborted(i) if i != self.island else None
            if report is not None:
                raise IslandAborted(f"island {i} failed: {report}")

    def gather_objects(self, key: str, obj: object) -> list:
        """Every island publishes ``obj`` under ``key``; returns all islands' objects in island order.

        Raises :class:`IslandAborted` as soon as another island reports a failure, and names the
        missing islands when none of them has sent a heartbeat for ``timeout``: a missing island
        that keeps stepping is slow, and is waited for.
        """
        self.publish(f"{key}/{self.island}", obj)
        keys = [f"{self.run_id}/{key}/{i}" for i in range(self.num_islands)]
        if not self.store.check(keys):  # the others are not all there yet: wait, watching them
            self._await_objects(key, keys)
        return [json.loads(value) for value in self.store.multi_get(keys)]

    def _await_objects(self, key: str, keys: list[str]) -> None:
        limit = self.timeout.total_seconds()
        started = time.monotonic()
        deadline = started + limit
        give_up = started + self.max_wait.total_seconds() if self.max_wait is not None else None
        period = min(1.0, limit / 4)  # how often the missing islands' heartbeats are compared
        # the missing islands' beats, first read a period in (not before: an island that arrives
        # while they are read would wait for the reads); progress is a change from one read to the next
        beats: dict[int, bytes | None] | None = None
        next_beat_check = started + period
        while not self.store.check(keys):
            self._check_aborts()
            now = time.monotonic()
            if now < next_beat_check and now <= deadline:
                time.sleep(0.01)
                continue
            next_beat_check = now + period
            missing = [i for i, k in enumerate(keys) if not self.store.check([k])]
            if not missing:
                break
            latest = self._heartbeats(missing)
            if beats is not None and any(latest[i] != beats.get(i) for i in missing):
                deadline = now + limit  # a missing island made progress: slow, not lost
            beats = {**(beats or {}), **latest}
            if now > deadline:
                raise IslandAborted(
                    f"islands {missing} did not reach {key!r} and showed no progress for {limit:g} s "
                    "(crashed, hung or never started); raise timeout_s if an island can legitimately "
                    "go this long without finishing a step"
                )
            if give_up is not None and now > give_up:
                raise IslandAborted(
                    f"islands {missing} are still training but did not reach {key!r} within "
                    f"{now - started:.0f} s (max_wait_s); give them fewer steps per round (balance=time, "
                    "steps_per_round) or raise max_wait_s"
                )
            time.sleep(0.01)

    # -- tensors over the lanes ----------------------------------------------------------------
    def _all_gather_sizes(self, n: int) -> list[int]:
        mine = torch.tensor([n], dtype=torch.int64)
        out = [torch.empty(1, dtype=torch.int64) for _ in self.present]
        self.lanes[0].allgather([out], [mine]).wait()
        return [int(t.item()) for t in out]

    def all_gather_bytes(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """All-gather one uint8 CPU tensor per island (sizes may differ); returns them in island order
        (an empty tensor for an island not present this round).

        The time until every island has announced its size is counted as waiting (for the slowest
        island); the rest as exchanging. The payload is cut into ``len(lanes)`` chunks that move in
        parallel. A lane that fails (a peer died) raises
        :class:`~lightning_islands.membership.RoundLost` instead of hanging.
        """
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise TypeError("payload must be a 1-D uint8 tensor")
        payload = payload.cpu().contiguous()
        present = self.present
        out = [torch.empty(0, dtype=torch.uint8) for _ in range(self.num_islands)]
        out[self.island] = payload
        if len(present) < 2:
            return out
        t0 = time.perf_counter()
        try:
            sizes = self._all_gather_sizes(payload.numel())
            t1 = time.perf_counter()
            got = self._pairwise(payload, sizes) if self.directed else self._ring(payload, sizes)
        except RuntimeError as err:
            raise self._lost("an all-gather", err) from err
        t2 = time.perf_counter()
        self.stats.seconds_waiting += t1 - t0
        self.stats.seconds_exchanging += t2 - t1
        self.stats.bytes_sent += payload.numel() * (len(present) - 1)
        self.stats.bytes_received += sum(s for i, s in zip(present, sizes) if i != self.island)
        for i, t in zip(present, got):
            out[i] = t
        return out

    def _pieces(self, size: int) -> list[tuple[int, int]]:
        """``[start, stop)`` of each lane's piece of a payload of ``size`` bytes."""
        per = -(-size // len(self.lanes)) if size else 0
        return [(min(k * per, size), min((k + 1) * per, size)) for k in range(len(self.lanes))]

    def _pairwise(self, payload: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Two islands: each lane's piece of this payload goes out on this island's direction and the
        peer's piece arrives on the other, straight into place (no padding, no copies)."""
        me = self.present.index(self.island)
        peer = 1 - me
        received = torch.empty(sizes[peer], dtype=torch.uint8)
        works = []
        for k, ((a, b), (c, d)) in enumerate(zip(self._pieces(sizes[me]), self._pieces(sizes[peer]))):
            if b > a:
                works.append(self.directed[k][me].send([payload[a:b]], peer, 0))
            if d > c:
                works.append(self.directed[k][peer].recv([received[c:d]], peer, 0))
        for w in works:
            w.wait()
        return [payload, received] if me == 0 else [received, payload]

    def _ring(self, payload: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Three or more islands: gloo's ring all-gather on every lane, over pieces padded to one size."""
        n_lanes = len(self.lanes)
        chunk = (max(sizes) + n_lanes - 1) // n_lanes if max(sizes) else 0
        if not chunk:
            return [torch.empty(0, dtype=torch.uint8) for _ in sizes]
        padded = torch.zeros(chunk * n_lanes, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        outs = [[torch.empty(chunk, dtype=torch.uint8) for _ in sizes] for _ in range(n_lanes)]
        works = [lane.allgather([outs[k]], [padded[k * chunk : (k + 1) * chunk]]) for k, lane in enumerate(self.lanes)]
        for w in works:
            w.wait()
        return [torch.cat([outs[k][i] for k in range(n_lanes)])[:size] for i, size in enumerate(sizes)]

    def broadcast_bytes(self, payload: torch.Tensor | None, src: int = 0) -> torch.Tensor:
        """Broadcast a uint8 tensor from island ``src`` to every island present (initial state, repairs)."""
        if self.island == src and len(self.present) < 2:
            return payload.cpu().contiguous() if payload is not None else torch.empty(0, dtype=torch.uint8)
        if src not in self.present:
            raise ValueError(f"island {src} is not present this round (present: {list(self.present)})")
        size = torch.tensor([payload.numel() if self.island == src and payload is not None else 0],
                            dtype=torch.int64)
        opts = dist.BroadcastOptions()
        opts.rootRank = self.present.index(src)
        t0 = time.perf_counter()
        try:
            self.lanes[0].broadcast([size], opts).wait()
            buf = payload.cpu().contiguous() if self.island == src and payload is not None else torch.empty(
                int(size.item()), dtype=torch.uint8)
            self.lanes[0].broadcast([buf], opts).wait()
        except RuntimeError as err:
            raise self._lost("a broadcast", err) from err
        self.stats.seconds_exchanging += time.perf_counter() - t0
        if self.island == src:
            self.stats.bytes_sent += buf.numel() * (len(self.present) - 1)
        else:
            self.stats.bytes_received += buf.numel()
        return buf

    def add_wait(self, seconds: float) -> None:
        """Count ``seconds`` (spent waiting for other islands outside this link) as waiting."""
        self.stats.seconds_waiting += seconds

    def take_stats(self) -> LinkStats:
        """Return the counters accumulated so far and start new ones."""
        stats, self.stats = self.stats, LinkStats()
        return stats

    def close(self) -> None:
        """Stop the liveness beat; drop the lanes and the store connection."""
        self._stop_alive()
        self.lanes, self.directed, self._lane_stores = [], [], []
        self.store = None  # type: ignore[assignment]
