"""An island's link to the others over a coordinator and gloo lanes: :class:`IslandLink`.

The leader (its global rank 0) connects to the coordinator (:mod:`.coordinator`), claims its
island index, beats its liveness (:mod:`.liveness`), takes part in every round's membership
decision (:mod:`.membership`) and moves payloads over the lanes of the round's member set
(:mod:`.lanes`), rebuilt whenever that set changes. Small objects go through the store. Nothing
here knows about Lightning, parameters or codecs; it moves uint8 tensors and small JSON objects and
counts what it moved. It implements :class:`~lightning_islands.link.protocol.Link`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, suppress
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from lightning_islands.link import liveness
from lightning_islands.link.auth import derive_key
from lightning_islands.link.coordinator import (
    ENV_ISLAND,
    ENV_LINK_IFNAME,
    ENV_RUN_ID,
    absent,
    connector,
    get_if_set,
    parse_address,
    restart_count,
    status_key,
)
from lightning_islands.link.etcd_store import is_etcd
from lightning_islands.link.lanes import START_LANES, Lanes
from lightning_islands.link.membership import Decision, Membership
from lightning_islands.link.protocol import (
    AuthenticationError,
    CoordinatorLost,
    DeadlinePassed,
    IslandAborted,
    LateForRound,
    LinkStats,
    PayloadRefused,
    RoundLost,
)
from lightning_islands.link.sealed import SealedStore
from lightning_islands.link.sweeper import Sweeper
from lightning_islands.link.waiting import SCAN_S, in_thread, wait_until

log = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_GRACE_S = 60.0  # grace_s when none is given
STORE_TIMEOUT = timedelta(seconds=60)  # connecting to the coordinator (at most the deadline): waits poll
# a transfer's deadline: twice grace_s (the peers' compute between their transfers; a silent peer is
# given up after one grace_s, before it) plus MARGIN times its bytes at the slowest rate measured over
# the last RATES transfers of at least RATE_MIN_BYTES;
# before the first measurement the rate is FIRST_RATE_BPS (1 Mbit/s: a stated, conservative guess)
MARGIN = 4.0
RATES = 8
RATE_MIN_BYTES = 64 * 1024
FIRST_RATE_BPS = 1e6


class IslandLink:
    """The leader's connection to the other islands: a store client plus ``lanes`` gloo groups.

    Joining claims the island index under ``run_id`` (a second claim fails: a duplicate island index
    or a reused run id). Small objects go through the store first (fingerprints); :meth:`open_lanes`
    then builds the gloo groups, so a mismatch is reported before anything can hang in them.

    Args:
        address: coordinator ``host:port``.
        island: this island's index in ``[0, num_islands)`` (any index not taken, when joining).
        num_islands: how many islands the run starts with (more may join, some may retire).
        run_id: namespace for this run's keys in the store (several runs may share a coordinator).
        lanes: parallel TCP streams per island pair; payloads are split across them.
        deadline: the longest one round may take (all its attempts), and the longest the start
            waits for islands that have not arrived; also the lanes' gloo timeout (the bound of a
            transfer nothing abandons first).
        interface: the network interface the lanes bind to (``None``: ``LI_LINK_IFNAME``, else
            gloo's default device). Only the lanes use it: the island's own process group keeps
            its own device.
        min_islands: the fewest islands a round may go on with (:mod:`lightning_islands.link.membership`).
        grace_s: how long an island may show no progress (its liveness beat stopped) before the
            others give it up (a number, or a callable asked each time); ``None``: 60 s.
        incarnation: this island's start count (a restarted island claims its index anew);
            ``None``: from ``TORCHELASTIC_RESTART_COUNT``.
        secret: the run's shared secret (:func:`~lightning_islands.link.auth.load_secret`): every
            value this island acts on is then sealed with a MAC (:mod:`lightning_islands.link.sealed`);
            ``None``: plain values.
        join: this island joins a run already under way (it enrolls and is taken in by a round,
            :meth:`rejoin`), instead of starting with the others.
        slow_wait_s: with the engine's ``max_staleness``, how long a round waits for an island alive
            but slow once a majority of the islands alive has arrived (seconds, or a callable asked
            each time); ``None`` (or a callable answering it): as long as it is alive (a barrier).
        rejoin_every: a round that went on without this island asks to take it back into one of
            the next rounds every so many (a callable is asked each time): a late island's
            overlapped round holds one fragment's snapshot (``IslandSettings.rejoin_every``).
    """

    def __init__(
        self,
        address: str,
        island: int,
        num_islands: int,
        run_id: str = "run",
        lanes: int = 2,
        deadline: timedelta = timedelta(hours=1),
        interface: str | None = None,
        min_islands: int = 1,
        grace_s: float | Callable[[], float] | None = None,
        incarnation: int | None = None,
        secret: bytes | None = None,
        join: bool = False,
        slow_wait_s: float | Callable[[], float | None] | None = None,
        rejoin_every: int | Callable[[], int] = 1,
    ) -> None:
        if not 0 <= island < num_islands and not (join and island >= 0):
            raise ValueError(f"island index {island} is outside [0, {num_islands}); check {ENV_ISLAND}")
        self.address = address
        self._etcd = is_etcd(address)
        store_timeout = min(deadline, STORE_TIMEOUT)
        self.lanes = Lanes(connector(address, store_timeout), lanes, deadline,
                           interface or os.environ.get(ENV_LINK_IFNAME) or None, f"island {island}")
        self.island = island
        self.run_id = run_id
        self.deadline = deadline
        self.rejoin_every = rejoin_every
        try:
            if self._etcd:
                self._plain = connector(address, store_timeout)()
                self._plain.check([f"{run_id}/joined"])  # the cluster answers, or EtcdUnreachable names it
            else:  # no socket probe first: the link's first connection waits for a coordinator still starting
                host, port = parse_address(address)
                self._plain = dist.TCPStore(host, port, is_master=False, timeout=store_timeout)
        except Exception as err:  # noqa: BLE001 - re-raised with the cause and the fix
            raise ConnectionError(
                f"island {island} could not reach the coordinator at {address} ({err}); start one with "
                "`lightning-islands coordinator --port PORT` (or `--etcd 3`) or let `lightning-islands run` start it"
            ) from err
        key = derive_key(secret, run_id) if secret else None

        def sealed(store: dist.Store) -> dist.Store:
            return SealedStore(store, key, island) if key is not None else store  # type: ignore[return-value]

        self.store = sealed(self._plain)  # the launcher's status lines stay plain (self._plain)
        self.incarnation = restart_count() if incarnation is None else incarnation
        # a claim that succeeds once (a create on etcd) with this process's own token: a request
        # retried after its reply was lost reads its own token back, not a second claim
        token = f"{os.getpid()}-{uuid.uuid4().hex}"
        claim = self.store.compare_set(f"{run_id}/joined/{island}/{self.incarnation}", "", token)
        if (claim.decode() if isinstance(claim, bytes) else claim) != token:
            raise RuntimeError(
                f"island {island} already joined run {run_id!r} on the coordinator at {address}: either two "
                f"islands were given the same index ({ENV_ISLAND}) or the run id is reused; give every launch "
                f"a fresh {ENV_RUN_ID}"
            )
        # the islands the lanes join
        self.present: tuple[int, ...] = (island,) if join else tuple(range(num_islands))
        self._lanes_key: str | None = None
        self.decision: Decision | None = None
        self.membership = Membership(self.store, run_id, island, num_islands if not join else island + 1, min_islands,
                                     DEFAULT_GRACE_S if grace_s is None else grace_s, deadline.total_seconds(),
                                     self._aborted, self.incarnation, joining=join)
        self.membership.slow_wait_s = slow_wait_s
        self.stats = LinkStats()
        self._rates: deque[float] = deque(maxlen=RATES)  # bytes per second of recent transfers
        # on etcd the beat is a lease of grace_s renewed only when the beat advances (progress):
        # an island silent for grace_s loses its beat key, and only that key
        connect_beat = connector(address, timedelta(seconds=liveness.CONNECT_S), connect_s=liveness.CONNECT_S,
                                 lease_ttl=lambda: self.membership.grace_s)

        def beat_connect() -> dist.Store:
            return sealed(connect_beat())
        self.alive = liveness.Beat(beat_connect, self.membership.alive_key(island), self.incarnation,
                                   f"island{island}-alive")
        self.alive.stop_with(self)
        connect_status = connector(address, timedelta(seconds=liveness.CONNECT_S), connect_s=liveness.CONNECT_S)
        self._status = liveness.StatusPublisher(connect_status, status_key(run_id, island), f"island{island}-status")
        weakref.finalize(self, self._status.stop, False)  # a link dropped without close() stops publishing
        self.membership.progress = self.alive.touch  # an island waiting within its deadline is alive
        if self._etcd:  # waits are watches on the run's keys, not polls
            self.membership.pause = lambda seconds: self._plain.await_change(f"{run_id}/", seconds)
        connect_sweeper = connector(address, store_timeout)
        self.membership.sweeper = Sweeper(lambda: sealed(connect_sweeper()), run_id, lambda: self.membership.size,
                                          lanes, f"island{island}-sweeper")

    @property
    def num_islands(self) -> int:
        """The length of lists in island order: the islands the run started with, or one more than the
        highest island present if that is more (islands joined)."""
        return max(self.membership.num_islands, max(self.present) + 1)

    @property
    def roster(self) -> tuple[int, ...]:
        """The run's islands as this one knows them: started or joined, not retired."""
        return tuple(sorted(self.membership.roster))

    def _aborted(self, island: int) -> str | None:
        """Island ``island``'s failure report, or ``None`` (also for a report of an earlier life of
        that island than its beat shows: left behind, or replayed at its key)."""
        raw = get_if_set(self.store, f"{self.run_id}/abort/{island}")
        if raw is None:
            return None
        try:
            report = json.loads(raw)
            incarnation, message = int(report["inc"]), str(report["message"])
        except (ValueError, KeyError, TypeError):
            incarnation, message = None, raw.decode(errors="replace")
        return None if self.membership.stale_report(island, incarnation) else message

    def open_lanes(self) -> None:
        """Build the gloo groups between every island (every island must call this after the
        fingerprint check); the rounds rebuild them whenever their member set changes.

        Between two islands each lane is two groups more, one per direction (:class:`Lanes`); with
        more islands the ring all-gather sends one way per connection.
        """
        try:
            self._build_lanes(START_LANES, tuple(range(self.num_islands)))
        except RuntimeError as err:
            raise IslandAborted(f"island {self.island} could not build the lanes to the other islands ({err}); "
                                "check that every island can reach the others' lane addresses") from err

    def _build_lanes(self, key: str, present: tuple[int, ...]) -> None:
        self.present, self._lanes_key = present, key
        self._watched(f"building the lanes to islands {list(present)}",
                      lambda: self.lanes.build(f"{self.run_id}/{key}/", present.index(self.island), len(present)))

    @property
    def lanes_key(self) -> str | None:
        """The key the current lanes were built under (it changes with the member set)."""
        return self._lanes_key

    @property
    def attempt_key(self) -> str | None:
        """The current round attempt's key (``round<r>/a<k>``), ``None`` before the first round."""
        return None if self.decision is None else self.decision.key

    # -- rounds: who takes part ------------------------------------------------------------------
    def meet_round(self, round_: int, header: dict) -> list[dict | None]:
        """Publish this island's header of round ``round_`` and return every island's, in island
        order (``None``: not present this round). The lanes are rebuilt when the member set changed.

        Raises :class:`~lightning_islands.link.protocol.LateForRound` (after asking to rejoin) when the
        round went on without this island, and :class:`~lightning_islands.link.protocol.QuorumLost`.
        """
        try:
            decision, headers = self.membership.decide(round_, header)
        except LateForRound:
            every = self.rejoin_every() if callable(self.rejoin_every) else self.rejoin_every
            self.membership.request_join(round_ + every, every)  # its catch-up's cadence from the start
            raise
        except dist.DistNetworkError as err:
            raise self._coordinator_lost(err) from err
        self.decision = decision
        if decision.lanes != self._lanes_key:
            try:
                self._build_lanes(decision.lanes, decision.present)
            except (RoundLost, IslandAborted):
                raise
            except RuntimeError as err:
                self.membership.retry(decision)
                raise RoundLost(f"round {round_}: the lanes to islands {list(decision.present)} could not be "
                                f"built ({err})") from err
        return headers

    def settle_round(self) -> None:
        """This island finished the round's exchange: wait until every member did (the round
        counts), or raise :class:`~lightning_islands.link.protocol.RoundLost` (run it again)."""
        if self.decision is not None:
            try:
                self.membership.settle(self.decision)
            except dist.DistNetworkError as err:
                raise self._coordinator_lost(err) from err
            self.alive.settle()  # a round counted: from now on the beat follows progress

    def end_run(self, round_: int) -> None:
        """The islands agreed that round ``round_`` is the last: an island still rejoining stops."""
        self.membership.end(round_)

    def retire_after(self, round_: int) -> None:
        """This island leaves the run for good once round ``round_`` counts (its header says so)."""
        self.membership.retire_after(round_)

    def rejoin(self, timeout_s: float, from_round: int = 0, every: int = 1) -> int:
        """Ask the live islands to take this (restarted, or late) island back, into one of rounds
        ``from_round``, ``from_round + every``, ...; returns the round they take it into (the caller
        then runs that round as a joiner)."""
        with suppress(Exception):
            self.store.delete_key(f"{self.run_id}/abort/{self.island}")  # a report of this island's earlier life
        try:
            self.membership.request_join(from_round, every)
            return self.membership.await_inclusion(timeout_s).round
        except dist.DistNetworkError as err:
            raise self._coordinator_lost(err) from err

    def membership_changes(self) -> list[str]:
        """The member-set changes seen since the last call (for the log)."""
        changes, self.membership.changes = self.membership.changes, []
        return changes

    def _coordinator_lost(self, err: Exception) -> CoordinatorLost:
        if self._etcd:
            return CoordinatorLost(
                f"island {self.island} lost the coordinator, the etcd cluster at {self.address} ({err}); the run "
                "cannot go on without a majority of its members (they hold the membership and every round's "
                "agreement). Restart the members that stopped; then restart the run from the islands' last "
                "checkpoints (resume=...)")
        return CoordinatorLost(
            f"island {self.island} lost the coordinator at {self.address} ({err}); the run cannot go on without it "
            "(it holds the membership and every round's agreement). Keep the coordinator running for the whole "
            "run; restart the run from the islands' last checkpoints (resume=...)")

    def _rate(self) -> float:
        """The rate a transfer's deadline assumes, in bytes per second: the slowest of the recent
        transfers, else :data:`FIRST_RATE_BPS`."""
        return min(self._rates) if self._rates else FIRST_RATE_BPS / 8

    def _measured(self, nbytes: int, seconds: float) -> None:
        if nbytes >= RATE_MIN_BYTES and seconds > 0:
            self._rates.append(nbytes / seconds)

    def _watched(self, what: str, move: Callable[[], T], nbytes: int = 0) -> T:
        """``move()`` (``nbytes`` to receive over the lanes) in a thread of its own while this one
        watches: the transfer is abandoned when a partner is lost (silent past ``grace_s``, failed
        or restarted: :meth:`Membership.lost_during`), when the attempt failed elsewhere, or past
        its deadline (twice ``grace_s`` plus :data:`MARGIN` times ``nbytes`` at :meth:`_rate`; the next
        attempt assumes half the rate). An abandoned transfer's groups are retired (an abandoned
        gloo operation leaves its group unusable; its thread ends when gloo's timeout fires) and,
        inside a round, :class:`RoundLost` runs the round again; past the round's deadline
        :class:`DeadlinePassed` ends the run; outside a round (the start) :class:`IslandAborted`.
        While the bytes move within their deadline, the island makes progress."""
        decision = self.decision
        rate = self._rate()
        started = time.monotonic()
        deadline = started + 2 * self.membership.grace_s + MARGIN * nbytes / rate
        last = self.membership.deadline(decision.round) if decision is not None else math.inf
        self.alive.touch()
        done, box = in_thread(move, f"island{self.island}-{what.split()[-1]}")
        while not done.wait(SCAN_S):
            now = time.monotonic()
            if decision is not None:
                why = self.membership.lost_during(decision)
            else:
                why = self.membership.lost_among(self.present)
            if why is None and now > deadline:
                why = (f"it took longer than its deadline of {deadline - started:.1f} s ({nbytes} bytes at "
                       f"{rate * 8 / 1e6:.3g} Mbit/s with a margin of {MARGIN:g}, plus twice grace_s)")
                self._rates = deque([rate / 2], maxlen=RATES)
            if why is None:
                self.alive.touch()
                continue
            self._lanes_key = None  # the next decision's lanes are built anew
            self.lanes.retire(done)
            message = f"island {self.island} gave up {what}: {why}"
            if decision is None:
                raise IslandAborted(f"{message}; the run cannot start without them: restart it")
            self.membership.retry(decision)
            if now > last:
                raise DeadlinePassed(f"{message}, and round {decision.round} passed its deadline (deadline_s="
                                     f"{self.deadline.total_seconds():g} s); raise islands.deadline_s")
            raise RoundLost(f"{message}; the round runs again")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        self._measured(nbytes, time.monotonic() - started)
        return box["result"]  # type: ignore[return-value]

    def fail_round(self, why: str) -> RoundLost | DeadlinePassed:
        """Another rank of this island lost its transfer in the round (the sliced exchange): the
        attempt is marked failed, so that every island runs the round again; past the round's
        deadline (``deadline_s``) :class:`DeadlinePassed` ends the run instead."""
        if self.decision is None:
            return RoundLost(f"island {self.island}: {why}; the round runs again")
        self.membership.retry(self.decision)
        if time.monotonic() > self.membership.deadline(self.decision.round):
            return DeadlinePassed(f"island {self.island}: {why}, and round {self.decision.round} passed its deadline "
                                  f"(deadline_s={self.deadline.total_seconds():g} s); raise islands.deadline_s or "
                                  "check that every rank of every island can reach the others' lanes")
        return RoundLost(f"island {self.island}: {why}; the round runs again")

    def _lost(self, what: str, err: Exception) -> RoundLost:
        """A lane failed mid-round: the attempt is marked failed, the round runs again."""
        if self.decision is not None:
            self.membership.retry(self.decision)
        return RoundLost(f"island {self.island} lost a peer during {what} ({err}); the round runs again without it")

    def abort(self, message: str) -> None:
        """Tell the other islands that this one failed, so they stop waiting for it with a clear error."""
        self.store.set(f"{self.run_id}/abort/{self.island}",  # bound to this life of the island
                       json.dumps({"inc": self.membership.incarnation, "message": message[:2000]}))

    # -- small objects through the store -------------------------------------------------------
    def publish(self, key: str, obj: object) -> None:
        """Set ``key`` (namespaced by run) to ``obj`` as JSON."""
        self.store.set(f"{self.run_id}/{key}", json.dumps(obj))

    def read_object(self, key: str, timeout_s: float) -> object:
        """The JSON object another island published under ``key``, once it is there; past
        ``timeout_s`` a :class:`DeadlinePassed` that names the key."""
        name = f"{self.run_id}/{key}"

        def expired() -> DeadlinePassed:
            return DeadlinePassed(f"island {self.island} found no {key!r} of run {self.run_id!r} at the coordinator "
                                  f"{self.address} within {timeout_s:g} s: is the run under way, with this run id "
                                  "(LI_RUN_ID)?")

        try:
            raw = wait_until(lambda: get_if_set(self.store, name), scan=lambda: None, expired=expired,
                             deadline=time.monotonic() + timeout_s, progress=self.alive.touch,
                             pause=self.membership.pause)
        except dist.DistNetworkError as err:
            raise self._coordinator_lost(err) from err
        return self._json(name, raw)

    def heartbeat(self, status: object) -> None:
        """This island made progress (a step): its liveness beat advances; ``status`` is published
        for the launcher to show, from a thread of its own (the caller never waits for the coordinator)."""
        self.alive.touch()
        self._status.publish(json.dumps(status))

    def beating(self, status: dict, period: float | None = None) -> AbstractContextManager[None]:
        """Count the body as progress, from a background thread (:func:`liveness.beating`), every
        ``period`` seconds (default: a quarter of ``grace_s``, at most 1 s), so the other islands
        keep waiting for this one instead of giving it up after ``grace_s``."""
        period = min(1.0, self.membership.grace_s / 4) if period is None else period
        return liveness.beating(connector(self.address, STORE_TIMEOUT), status_key(self.run_id, self.island),
                                status, period, f"island{self.island}-heartbeat", progress=self.alive.touch)

    def _check_aborts(self) -> None:
        for i in self.roster:
            report = self._aborted(i) if i != self.island else None
            if report is not None:
                raise IslandAborted(f"island {i} failed: {report}")

    def gather_objects(self, key: str, obj: object) -> list:
        """Every island publishes ``obj`` under ``key``; returns all islands' objects in island order.

        For the start (fingerprints, the start's agreement): raises :class:`IslandAborted` as soon as
        another island reports a failure or, once seen beating, shows no progress for ``grace_s``;
        an island not seen yet (still starting) is waited for up to ``deadline``
        (:class:`DeadlinePassed`, naming the islands missing).
        """
        self.publish(f"{key}/{self.island}", obj)
        keys = [f"{self.run_id}/{key}/{i}" for i in range(self.num_islands)]
        missing: list[int] = []

        def scan() -> bool | None:
            self._check_aborts()
            missing[:] = absent(self.store, dict(enumerate(keys)))
            if not missing:
                return True
            stopped = self.membership.stopped(missing)
            if stopped:
                raise IslandAborted(f"islands {stopped} did not reach {key!r} and showed no progress for "
                                    f"{self.membership.grace_s:g} s (grace_s: crashed, hung or cut off); raise "
                                    "islands.grace_s if an island can legitimately go this long without a step")
            return None

        def expired() -> DeadlinePassed:
            return DeadlinePassed(f"islands {missing} did not reach {key!r} within deadline_s="
                                  f"{self.deadline.total_seconds():g} s (never started, or still starting); start "
                                  "them or raise islands.deadline_s")

        wait_until(lambda: True if self.store.check(keys) else None, scan=scan, expired=expired,
                   deadline=time.monotonic() + self.deadline.total_seconds(), progress=self.alive.touch,
                   pause=self.membership.pause)
        return [self._json(keys[i], value) for i, value in enumerate(self.store.multi_get(keys))]

    def _json(self, name: str, value: bytes) -> object:
        """``value`` (under ``name``) parsed; a sealed value this island cannot read is named."""
        try:
            return json.loads(value)
        except ValueError as err:
            raise AuthenticationError(
                f"island {self.island} cannot read the value under {name!r} at the coordinator: it is not plain "
                f"JSON, as a value sealed with the run's secret is not, while island {self.island} runs without one; "
                "give every island the same secret (LI_SECRET or the same secret file; see SECURITY.md)") from err

    # -- tensors over the lanes ----------------------------------------------------------------
    def all_gather_bytes(self, payload: torch.Tensor, limit: int | None = None) -> list[torch.Tensor]:
        """All-gather one uint8 CPU tensor per island (sizes may differ); returns them in island order
        (an empty tensor for an island not present this round). A size announced below 0 or above
        ``limit`` is :class:`PayloadRefused` before anything is allocated for it.

        The time until every island has announced its size is counted as waiting (for the slowest
        island); the rest as exchanging. The payload is cut into ``len(lanes)`` chunks that move in
        parallel. A lane that fails (a peer died) raises
        :class:`~lightning_islands.link.protocol.RoundLost` instead of hanging.
        """
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise TypeError("payload must be a 1-D uint8 tensor")
        payload = payload.cpu().contiguous()
        present = self.present
        out = [torch.empty(0, dtype=torch.uint8) for _ in range(self.num_islands)]
        out[self.island] = payload
        if len(present) < 2:
            return out
        got = self._sized_transfer("an all-gather", present, lambda: self.lanes.sizes(payload.numel()),
                                   lambda sizes: self.lanes.all_gather(payload, sizes), payload.numel(), limit)
        for i, t in zip(present, got):
            out[i] = t
        return out

    def swap_bytes(self, payload: torch.Tensor, peers: Sequence[int], limit: int | None = None
                   ) -> dict[int, torch.Tensor]:
        """Send one uint8 CPU tensor to each island of ``peers`` present this round and receive each
        one's (:meth:`Link.swap_bytes`); sizes are swapped first and refused above ``limit``, as in
        :meth:`all_gather_bytes`, whose accounting and failure handling it shares."""
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise TypeError("payload must be a 1-D uint8 tensor")
        payload = payload.cpu().contiguous()
        present = self.present
        islands = [i for i in peers if i in present and i != self.island]
        if not islands:
            return {}
        ranks = [present.index(i) for i in islands]
        got = self._sized_transfer("a swap", islands, lambda: self.lanes.swap_sizes(payload.numel(), ranks),
                                   lambda sizes: self.lanes.swap(payload, ranks, sizes), payload.numel(), limit)
        return dict(zip(islands, got))

    def _sized_transfer(self, what: str, islands: Sequence[int], sizes_of: Callable[[], list[int]],
                        move: Callable[[list[int]], list[torch.Tensor]], sent: int,
                        limit: int | None) -> list[torch.Tensor]:
        """A transfer among ``islands`` (this one's ``sent`` bytes go to each other one): their sizes
        (``sizes_of()``, in ``islands``' order), refused above ``limit`` before anything is allocated,
        then ``move(sizes)``, both watched (:meth:`_watched`); a failed lane is :class:`RoundLost`.
        Until the sizes are known counts as waiting (for the slowest island), the rest as exchanging."""
        t0 = time.perf_counter()
        try:
            sizes = self._watched(f"{what}'s sizes", sizes_of)
            self._check_sizes(what, dict(zip(islands, sizes)), limit)
            t1 = time.perf_counter()
            incoming = sum(n for i, n in zip(islands, sizes) if i != self.island)
            got = self._watched(what, lambda: move(sizes), incoming)
        except (RoundLost, IslandAborted, PayloadRefused):
            raise
        except RuntimeError as err:
            raise self._lost(what, err) from err
        t2 = time.perf_counter()
        self.stats.seconds_waiting += t1 - t0
        self.stats.seconds_exchanging += t2 - t1
        self.stats.bytes_sent += sent * sum(1 for i in islands if i != self.island)
        self.stats.bytes_received += incoming
        return got

    def broadcast_bytes(self, payload: torch.Tensor | None, src: int = 0, limit: int | None = None) -> torch.Tensor:
        """Broadcast a uint8 tensor from island ``src`` to every island present (initial state, repairs)."""
        if self.island == src and len(self.present) < 2:
            return payload.cpu().contiguous() if payload is not None else torch.empty(0, dtype=torch.uint8)
        if src not in self.present:
            raise ValueError(f"island {src} is not present this round (present: {list(self.present)})")
        t0 = time.perf_counter()
        root, mine = self.present.index(src), payload if self.island == src else None
        try:
            size = self._watched("a broadcast's size", lambda: self.lanes.broadcast_size(mine, root))
            self._check_sizes("a broadcast", {src: size}, limit)
            buf = self._watched("a broadcast", lambda: self.lanes.broadcast(mine, root, size), size)
        except (RoundLost, IslandAborted, PayloadRefused):
            raise
        except RuntimeError as err:
            raise self._lost("a broadcast", err) from err
        self.stats.seconds_exchanging += time.perf_counter() - t0
        if self.island == src:
            self.stats.bytes_sent += buf.numel() * (len(self.present) - 1)
        else:
            self.stats.bytes_received += buf.numel()
        return buf

    def _check_sizes(self, what: str, sizes: dict[int, int], limit: int | None) -> None:
        """Refuse sizes no honest island announces, before anything is allocated for them."""
        bad = {i: n for i, n in sizes.items() if i != self.island and (n < 0 or limit is not None and n > limit)}
        if bad:
            message = (f"{what}: island(s) {sorted(bad)} announced {sorted(bad.values())} bytes, outside 0.."
                       f"{limit if limit is not None else 'any'} (the most an honest island sends here, its tag "
                       "included): a misbehaving or impersonated island; refused before allocating")
            log.error("lightning_islands: island %d refused a payload: %s", self.island, message)
            raise PayloadRefused(message)

    def add_wait(self, seconds: float) -> None:
        """Count ``seconds`` (spent waiting for other islands outside this link) as waiting."""
        self.stats.seconds_waiting += seconds

    def take_stats(self) -> LinkStats:
        """Return the counters accumulated so far and start new ones."""
        stats, self.stats = self.stats, LinkStats()
        return stats

    def close(self) -> None:
        """Stop the liveness beat; drop the lanes and the store connection."""
        self.alive.stop()
        self._status.stop()
        if self.membership.sweeper is not None:
            self.membership.sweeper.stop()
        self.lanes.close()
        self.store = None  # type: ignore[assignment]
