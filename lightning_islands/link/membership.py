"""Which islands take part in a round: decided once, atomically, in the coordinator's store.

Every island's leader publishes its round header under the round's key and waits. The round's
member set is decided as soon as every island expected is there, or once the missing ones have been
silent (their liveness beat, which follows their progress, stopped) for the grace window, provided
at least ``min_islands`` arrived. Whichever island decides first writes the set with ``compare_set``; every
island then reads the same set from the store. Islands expected are those of the previous round plus
those asking to (re)join.

The run's islands (its roster) change while it runs. A new island, with an index beyond those the run
started with, enrolls (an entry in a log at the coordinator, numbered with ``add``) and asks to join
like a restarted island; every decider reads the log's count once a round. An island retires
for good by saying so in its last round's header: once that round counted, no round expects it, and
every later decision carries it among the ``retired`` (so an island that missed that round learns it too).

A round is an attempt: when an island is lost during the exchange (its lanes fail), every survivor
marks the attempt failed and the round runs again with the islands still alive. An attempt counts
only when every member said it finished its exchange (:meth:`Membership.settle`): the outcome, too,
is written once with ``compare_set``, so no two live islands disagree on whether a round happened.

Every wait here is :func:`~lightning_islands.link.waiting.wait_until`, bounded by the round's
deadline (``deadline_s`` from this island's first meeting of the round, all attempts included): past
it the run ends with :class:`~lightning_islands.link.protocol.DeadlinePassed`, naming the islands
waited for. Nothing here knows about tensors or lanes; it reads and writes small keys.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from lightning_islands.link.coordinator import absent, get_if_set, status_key
from lightning_islands.link.lanes import START_LANES
from lightning_islands.link.protocol import (
    AuthenticationError,
    DeadlinePassed,
    LateForRound,
    QuorumLost,
    RoundLost,
    RunEnded,
)
from lightning_islands.link.sealed import SealedStore
from lightning_islands.link.sweeper import KEEP_ROUNDS, SWEPT, Sweeper
from lightning_islands.link.waiting import POLL_S, wait_until

log = logging.getLogger(__name__)
# how old an island's published status may be (it publishes at most every 0.5 s, from a thread)
STATUS_AGE_S = 1.0


@dataclass(frozen=True)
class Decision:
    """One attempt of one round, as decided in the store.

    ``present``: the islands whose payloads move in this attempt, ascending; ``lanes``: the key the
    lanes of this member set are built under (the same as the previous round's while the set stays).
    """

    round: int
    attempt: int
    present: tuple[int, ...]
    lanes: str
    joining: tuple[int, ...] = ()
    joining_incs: tuple[int, ...] = ()  # each joiner's incarnation (a later restart of it is another process)
    retired: tuple[int, ...] = ()  # the islands that left the run for good before this round

    @property
    def key(self) -> str:
        """Where this attempt's keys live in the run's namespace."""
        return f"round{self.round}/a{self.attempt}"

    def to_json(self) -> str:
        return json.dumps({"round": self.round, "attempt": self.attempt, "present": list(self.present),
                           "lanes": self.lanes, "joining": list(self.joining), "joining_incs": list(self.joining_incs),
                           "retired": list(self.retired)})

    @staticmethod
    def from_json(text: bytes | str) -> Decision:
        d = json.loads(text)
        return Decision(int(d["round"]), int(d["attempt"]), tuple(d["present"]), str(d["lanes"]),
                        tuple(d.get("joining", ())), tuple(d.get("joining_incs", ())), tuple(d.get("retired", ())))


def beat_order(beat: bytes | None) -> tuple[int, int] | None:
    """A liveness beat ``b"INCARNATION:COUNT"`` as a pair that grows with progress (``None``: none
    or unreadable)."""
    try:
        inc, count = (beat or b"").decode().split(":", 1)
        return int(inc), int(count)
    except ValueError:
        return None


@dataclass
class _Watch:
    """When each island's liveness beat last advanced, as seen from here, and the furthest beat.

    Only a beat past the furthest one seen (a higher count, or a later incarnation) is progress: a
    beat replayed at its key (an earlier one of this life, or one of an earlier life) is not, and
    does not make the island look restarted."""

    seen: dict[int, tuple[bytes | None, float]] = field(default_factory=dict)

    def silent_for(self, island: int, beat: bytes | None, now: float) -> float:
        last = self.seen.get(island)
        if last is None:
            self.seen[island] = (beat, now)
            return 0.0
        if beat is None:  # none yet, or gone with its lease (etcd): no progress since the last beat seen
            return now - last[1]
        new, old = beat_order(beat), beat_order(last[0])
        if new is not None and old is not None:
            advanced = new > old
        else:  # no readable beat yet: any change is progress
            advanced = old is None and beat != last[0]
        if advanced:
            self.seen[island] = (beat, now)
            return 0.0
        return now - last[1]


class Membership:
    """One island's side of the per-round membership protocol (the leader's).

    Args:
        store: a client of the coordinator's store.
        run_id: the run's namespace.
        island: this island; ``num_islands``: how many the run started with (islands ``0 ..
            num_islands - 1``; more may join later, some may retire).
        min_islands: the fewest islands a round may proceed with.
        grace_s: how long a missing island may stay silent (no liveness beat) before a round goes on
            without it; a callable is asked each time (the expected round length can change).
        deadline_s: the longest a round may take on this island, from its first meeting of the
            round until the round counts, all attempts included (``None``: no deadline).
        aborted: ``aborted(i)``: island ``i``'s failure report, or ``None``.
        incarnation: this island's start count (its liveness beat reads ``"INCARNATION:COUNT"``):
            a member whose beat shows another incarnation was restarted, so the process that was a
            member is gone.
        progress: called while this island waits within its deadline (its liveness beat's touch).
        joining: this island is new to a running run (it learns the roster from the coordinator).
    """

    def __init__(self, store: dist.Store, run_id: str, island: int, num_islands: int, min_islands: int,
                 grace_s: float | Callable[[], float], deadline_s: float | None,
                 aborted: Callable[[int], str | None], incarnation: int = 0,
                 progress: Callable[[], None] | None = None, joining: bool = False) -> None:
        if not 1 <= min_islands <= max(num_islands, island + 1):
            raise ValueError(f"min_islands must be in [1, {num_islands}], got {min_islands}")
        self.store, self.run_id, self.island, self.num_islands = store, run_id, island, num_islands
        self.min_islands = min_islands
        self._grace = grace_s
        self.deadline_s = deadline_s
        self.progress = progress
        self._deadlines: dict[int, float] = {}  # round -> when this island gives it up (time.monotonic)
        self.aborted = aborted
        self.incarnation = incarnation
        self._incs: dict[int, int] = {}  # the incarnation of each island in this island's current attempt
        self.previous: Decision | None = None  # the last attempt this island took part in
        self.committed: Decision | None = None  # the last attempt that counted
        self._watch = _Watch()
        self._stale_seen: set[tuple[int, str]] = set()
        self._attempt: dict[int, int] = {}  # round -> the attempt this island is at
        # whether this island still holds the lanes every island opened at the start: only then may it
        # propose them (an island that was left behind, or restarted, has lost them)
        self.holds_start_lanes = True
        self.changes: list[str] = []  # membership changes seen, for the log
        self.sweeper: Sweeper | None = None  # deletes rounds long over (the link's; none: kept)
        self.pause: Callable[[float], None] | None = None  # between polls (the link's watch on etcd; none: sleep)
        # the run's islands as far as this island knows: started or enrolled, not retired
        self.roster: set[int] = set() if joining else set(range(num_islands))
        self.retired: set[int] = set()
        self._enrolled = 0  # the enrolment log's entries counted so far
        self._unwritten: set[int] = set()  # entries counted but not found written yet
        self.leaving: int | None = None  # the round after which this island retires (None: it stays)
        self._leaving: dict[int, set[int]] = {}  # round -> the islands that retire after it (their headers say)
        self._requests: dict[int, bytes] = {}  # the last join request seen of each island
        self._request: dict = {"from": 0}  # this island's own last join request
        # max_staleness: an island alive but slow is waited for at most this long (seconds, or a callable
        # asked each time) once a majority of the islands alive has arrived; None: as long as it is
        # alive, a barrier
        self.slow_wait_s: float | Callable[[], float | None] | None = None

    @property
    def size(self) -> int:
        """One more than the highest island index known (lists in island order have this length)."""
        present = self.previous.present if self.previous is not None else ()
        return max([self.island, *self.roster, *present]) + 1

    @property
    def grace_s(self) -> float:
        return float(self._grace() if callable(self._grace) else self._grace)

    # ------------------------------------------------------------------ keys
    def _k(self, key: str) -> str:
        return f"{self.run_id}/{key}"

    def alive_key(self, island: int) -> str:
        """Where island ``island``'s liveness beat lives."""
        return self._k(f"alive/{island}")

    def _get(self, key: str) -> bytes | None:
        return get_if_set(self.store, key)

    def _silent(self, islands: Sequence[int], now: float) -> dict[int, float]:
        return {i: self._watch.silent_for(i, self._get(self.alive_key(i)), now) for i in islands}

    def _beat_incarnation(self, island: int) -> int | None:
        """The incarnation in island ``island``'s beat as :meth:`_silent` last read it."""
        beat = self._watch.seen.get(island, (None, 0.0))[0]
        try:
            return None if beat is None else int(beat.decode().split(":", 1)[0])
        except ValueError:
            return None

    def _gone(self, island: int, silent: float, incarnation: int | None = None) -> bool:
        """Whether island ``island`` is lost: silent past the grace window, failed, or (given the
        ``incarnation`` that took part) restarted since."""
        if silent > self.grace_s or self.aborted(island) is not None:
            return True
        return incarnation is not None and self._beat_incarnation(island) not in (None, incarnation)

    def deadline(self, round_: int) -> float:
        """When round ``round_`` must have counted on this island (``time.monotonic()``); its clock
        starts at this island's first meeting of the round."""
        if round_ not in self._deadlines:
            self._deadlines = {r: t for r, t in self._deadlines.items() if r >= round_ - 1}
            self._deadlines[round_] = time.monotonic() + (math.inf if self.deadline_s is None else self.deadline_s)
        return self._deadlines[round_]

    def _wait(self, round_: int, ready: Callable[[], Any], scan: Callable[[], Any],
              waiting_for: Callable[[], str]) -> Any:
        """:func:`wait_until` within round ``round_``'s deadline; past it :class:`DeadlinePassed`
        says ``waiting_for()`` (the islands waited for) and the fix."""
        def expired() -> DeadlinePassed:
            return DeadlinePassed(
                f"round {round_} did not finish within deadline_s={self.deadline_s:g} s on island {self.island}: "
                f"{waiting_for()}. Give slow islands fewer steps per round (islands.balance=time or their "
                "steps_per_round) or raise islands.deadline_s")
        return wait_until(ready, scan=scan, deadline=self.deadline(round_), expired=expired, progress=self.progress,
                          pause=self.pause)

    def joiners(self, round_: int) -> dict[int, int]:
        """Islands asking to (re)join at round ``round_`` (from their request's round on, every its
        ``every`` rounds), with their incarnations."""
        found = {}
        for i in sorted(self.roster - self.retired):
            raw = self._get(self._k(f"join/{i}")) if i != self.island else None
            if raw is not None:
                request = json.loads(raw)
                seen = self._beat_incarnation(i)
                if seen is not None and int(request["inc"]) < seen:  # from an earlier life: replayed, or stale
                    self._stale(i, f"join request of its incarnation {request['inc']}", seen)
                elif _asks_for(request, round_):
                    found[i] = int(request["inc"])
                    if self._requests.get(i) != raw:  # a new request is a sign of life: silence counts from now
                        self._requests[i] = raw
                        self._watch.seen.pop(i, None)
        return found

    def _stale(self, island: int, what: str, seen: int) -> None:
        """Log (once per value) that island ``island``'s ``what`` belongs to an earlier life."""
        if (island, what) not in self._stale_seen:
            self._stale_seen.add((island, what))
            log.warning("lightning_islands: island %d ignores island %d's %s: that island is in its incarnation "
                        "%d now (a value of its earlier life, left or replayed at its key)", self.island, island,
                        what, seen)

    def stale_report(self, island: int, incarnation: int | None) -> bool:
        """Whether a failure report that island ``island``'s ``incarnation`` wrote is of an earlier
        life than the one its beat shows (then it is ignored, and logged once)."""
        seen = self._beat_incarnation(island)
        if incarnation is None or seen is None or incarnation >= seen:
            return False
        self._stale(island, f"failure report of its incarnation {incarnation}", seen)
        return True

    # ------------------------------------------------------------------ one round
    def decide(self, round_: int, header: dict[str, Any]) -> tuple[Decision, list[dict[str, Any] | None]]:
        """Publish ``header`` for round ``round_`` and wait for its member set; returns the decision
        and every island's header in island order (``None`` for an island not present).

        Raises :class:`LateForRound` when the round was decided without this island and
        :class:`QuorumLost` when fewer than ``min_islands`` islands are alive.
        """
        while True:
            attempt = self._attempt.setdefault(round_, 0)
            mine = {**header, "_inc": self.incarnation, **({"_leave": True} if self.leaving == round_ else {})}
            decision, all_there = self._decision_of(round_, attempt, mine)
            self.retired |= set(decision.retired)
            self.roster = (self.roster | set(decision.present)) - self.retired
            for j in decision.joining:  # where a restarted joiner learns which round takes it in
                if j != self.island:
                    self.store.set(self._k(f"joined_at/{j}"), decision.to_json())
            if self.island not in decision.present or (
                    self.island in decision.joining
                    and decision.joining_incs[decision.joining.index(self.island)] != self.incarnation):
                raise LateForRound(f"round {round_} was decided without island {self.island} (members "
                                   f"{list(decision.present)}): it arrived after the grace window")
            try:
                headers = self._headers(decision, all_there)
            except RoundLost:
                self.retry(decision)
                continue
            self._incs = {i: int(h.pop("_inc", 0)) for i, h in enumerate(headers) if h is not None}
            self._leaving[round_] = {i for i, h in enumerate(headers) if h is not None and h.pop("_leave", False)}
            for j, inc in zip(decision.joining, decision.joining_incs):
                if j in self._incs and self._incs[j] != inc:
                    message = (f"island {self.island} refused island {j}'s round {round_} header: it was written by "
                               f"island {j}'s incarnation {self._incs[j]}, but the round takes in its incarnation "
                               f"{inc} (a header of its earlier life, replayed at its key)")
                    log.error("lightning_islands: %s", message)
                    raise AuthenticationError(message)
            self._note(decision)
            return decision, headers

    def _decision_of(self, round_: int, attempt: int, header: dict[str, Any]) -> tuple[Decision, bool]:
        """Publish ``header`` and return the attempt's decision, and whether every island's header was
        seen there (then :meth:`_headers` need not look again)."""
        key = f"round{round_}/a{attempt}"
        self.store.set(self._k(f"{key}/h/{self.island}"), json.dumps(header))
        self.read_enrolments()
        expected = (set(self.previous.present) - self.retired if self.previous else set(self.roster)) | {self.island}
        waited_for = [self._k(f"{key}/h/{i}") for i in sorted(expected)]
        missing: list[int] = []  # the islands still waited for, for the deadline's message
        since = time.monotonic()  # when this island began waiting for the attempt's members

        def ready() -> tuple[Decision, bool] | None:
            if not self.store.check(waited_for):
                return None
            if self.roster <= expected:
                # every island of the run is here (a round's usual case, one round trip): the scan
                # below would find no one missing and no joiner (a joiner sends its header only once
                # a decision names it), so it would propose them all; compare_set returns an earlier
                # decision where there is one
                return self._propose(round_, attempt, tuple(sorted(expected)), (), ()), True
            return scan()

        def scan() -> tuple[Decision, bool] | None:
            found = self._get(self._k(f"{key}/members"))
            if found is not None:
                return Decision.from_json(found), False
            self._check_ended(round_)
            self._check_current(round_)
            if self._get(self._k(f"round{round_ + 1}/a0/members")) is not None:  # resumed behind the others
                raise LateForRound(f"round {round_} was passed over: the other islands decided round {round_ + 1}")
            arrived = {i for i in sorted(self.roster | expected) if self.store.check([self._k(f"{key}/h/{i}")])}
            # a joiner sends its header once the decision names it: it is waited for only if alive
            asking = self.joiners(round_)
            joiners = set(asking) - arrived
            away = expected - arrived - joiners
            silent = self._silent(sorted(away | joiners), time.monotonic())
            gone = {i for i in away | joiners if self._gone(i, silent[i])}
            alive = arrived | (away - gone) | (joiners - gone)
            missing[:] = sorted(away - gone)
            if len(alive) < self.min_islands:
                raise QuorumLost(
                    f"round {round_}: only islands {sorted(alive)} are alive, fewer than "
                    f"min_islands={self.min_islands}; islands {sorted(gone)} were silent for more than "
                    f"{self.grace_s:g} s (grace_s) or failed. Restart them (they rejoin) or lower islands.min_islands")
            present = tuple(sorted(arrived | (joiners - gone)))
            if missing and self._gives_up_on_slow(round_, missing, arrived, alive, since):
                missing[:] = []
            if missing or len(present) < self.min_islands:
                return None
            joining = tuple(sorted(joiners - gone))
            return self._propose(round_, attempt, present, joining, tuple(asking[j] for j in joining)), False

        return self._wait(round_, ready, scan, lambda: f"islands {missing} are alive but did not arrive at its "
                                                       "meeting (still training)")

    def _gives_up_on_slow(self, round_: int, slow: Sequence[int], arrived: set[int], alive: set[int],
                          since: float) -> bool:
        """With ``slow_wait_s`` set (max_staleness): whether the round goes on without the islands
        ``slow`` (alive, not arrived): a majority of the islands alive has arrived, at least
        ``min_islands`` of them, and this island has waited ``slow_wait_s`` since it arrived, or
        every one of them reports that it arrives later than that (:meth:`_arrives_after`)."""
        wait = self.slow_wait_s() if callable(self.slow_wait_s) else self.slow_wait_s
        if wait is None or len(arrived) < self.min_islands or 2 * len(arrived) <= len(alive):
            return False
        left = wait - (time.monotonic() - since)
        reported = left > 0 and all(self._arrives_after(round_, j, left) for j in slow)
        if left > 0 and not reported:
            return False
        why = "they report arriving later" if reported else "alive but slower"
        log.warning("lightning_islands: island %d: round %d goes on without islands %s (%s than the wait for slow "
                    "islands, %g s); their work is merged into a later round (max_staleness)", self.island, round_,
                    list(slow), why, wait)
        return True

    def _arrives_after(self, round_: int, island: int, seconds: float) -> bool:
        """Whether island ``island``'s status (its leader publishes it every half second or so, with
        its round and ``eta_s``, the seconds its steps left in the round take at its pace) says
        that it reaches round ``round_`` more than ``seconds`` from now: it is in an earlier round,
        or its steps left take longer (by more than the status's age, ``STATUS_AGE_S``). Without a
        status, or one without ``eta_s``, it may be about to arrive. A forged status can only make
        the others go on without an island, as withholding its header could."""
        raw = self._get(status_key(self.run_id, island))
        try:
            status = json.loads(raw) if raw is not None else {}
            behind, eta = int(status.get("round", round_)) < round_, status.get("eta_s")
            return behind or (eta is not None and float(eta) > seconds + STATUS_AGE_S)
        except (ValueError, TypeError, AttributeError):
            return False

    def _propose(self, round_: int, attempt: int, present: tuple[int, ...], joining: tuple[int, ...],
                 joining_incs: tuple[int, ...]) -> Decision:
        # the lanes stay while the members do: this island took part in the previous round with the same set
        done = self.committed
        keep = (attempt == 0 and done is not None and done.round == round_ - 1 and done.present == present
                and not joining)
        # the run's first round with every island: the lanes they all opened at the start. Only an island
        # that still holds them proposes them: one left behind (or restarted) has no committed round
        # either, and naming the start's key again would rebuild every island on rendezvous keys that
        # hold old addresses
        first = (attempt == 0 and done is None and self.holds_start_lanes and present == tuple(range(self.num_islands))
                 and not joining)
        lanes = done.lanes if keep else START_LANES if first else f"round{round_}/a{attempt}"  # type: ignore
        mine = Decision(round_, attempt, present, lanes, joining, joining_incs, tuple(sorted(self.retired)))
        key = self._k(f"round{round_}/a{attempt}/members")
        won = self.store.compare_set(key, "", mine.to_json())
        return Decision.from_json(won)

    def _headers(self, decision: Decision, all_there: bool) -> list[dict[str, Any] | None]:
        """Every present island's header (a joiner publishes its own once it sees the decision);
        ``all_there``: every island's header is known to be there."""
        keys = {i: self._k(f"{decision.key}/h/{i}") for i in decision.present}
        if not all_there and not self.store.check(list(keys.values())):
            self._await_headers(decision, keys)
        got = dict(zip(keys, self.store.multi_get(list(keys.values()))))  # all there: one request
        size = max(self.num_islands, max(decision.present) + 1)  # the islands it started with, or more
        return [json.loads(got[i]) if i in got else None for i in range(size)]

    def _await_headers(self, decision: Decision, keys: dict[int, str]) -> None:
        """Wait until every header in ``keys`` is there; :class:`RoundLost` when an island is lost."""
        incs = dict(zip(decision.joining, decision.joining_incs))
        missing: list[int] = []

        def scan() -> bool | None:
            missing[:] = absent(self.store, keys)
            if not missing:
                return True
            if self._outcome(decision) == "fail":
                raise RoundLost(f"round {decision.round} attempt {decision.attempt} failed on another island")
            silent = self._silent(missing, time.monotonic())
            lost = [i for i in missing if self._gone(i, silent[i], incs.get(i))]
            if lost:
                raise RoundLost(f"islands {lost} were lost before sending their round {decision.round} header "
                                f"(silent for more than {self.grace_s:g} s, failed, or restarted)")
            return None

        self._wait(decision.round, lambda: True if self.store.check(list(keys.values())) else None, scan,
                   lambda: f"joining islands {missing} did not send their header")

    def _note(self, decision: Decision) -> None:
        prev = self.previous
        if decision.joining or (prev is None and len(decision.present) < self.num_islands) or (
                prev is not None and prev.present != decision.present):
            before = list(prev.present) if prev else sorted(self.roster - set(decision.joining))
            self.changes.append(f"round {decision.round}: members {before} -> {list(decision.present)}"
                                + (f" (joining: {list(decision.joining)})" if decision.joining else ""))
        self.previous = decision

    # ------------------------------------------------------------------ the outcome
    def _outcome(self, decision: Decision) -> str | None:
        found = self._get(self._k(f"{decision.key}/outcome"))
        return None if found is None else found.decode()

    def lost_during(self, decision: Decision) -> str | None:
        """Why the attempt ``decision`` cannot count any more, or ``None``: another island marked it
        failed, or a member is lost (silent past the grace window, failed, or restarted). For the
        waits that move its bytes: a member that stopped without a reset (power lost, the process
        stopped, the link cut) is noticed here within ``grace_s``, not by the transfer's timeout."""
        if self._outcome(decision) == "fail":
            return f"round {decision.round} attempt {decision.attempt} failed on another island"
        incs = {**self._incs, **dict(zip(decision.joining, decision.joining_incs))}
        return self.lost_among(decision.present, incs, f"while round {decision.round}'s bytes moved")

    def lost_among(self, islands: Sequence[int], incarnations: dict[int, int] | None = None,
                   when: str = "while bytes moved") -> str | None:
        """Why some of ``islands`` (other than this one) are lost, or ``None``: silent past the grace
        window, failed, or (given the ``incarnations`` that took part) restarted."""
        others = [i for i in islands if i != self.island]
        silent = self._silent(others, time.monotonic())
        lost = [i for i in others if self._gone(i, silent[i], (incarnations or {}).get(i))]
        if lost:
            return f"islands {lost} were lost (silent for more than {self.grace_s:g} s, failed, or restarted) {when}"
        return None

    def seen(self, island: int) -> bool:
        """Whether island ``island``'s liveness beat has been read here (it started)."""
        return self._watch.seen.get(island, (None, 0.0))[0] is not None

    def stopped(self, islands: Sequence[int]) -> list[int]:
        """Those of ``islands`` that started (their beat was seen) and then showed no progress for
        ``grace_s``; an island not seen yet is still starting, not stopped."""
        silent = self._silent(islands, time.monotonic())
        return [i for i in islands if self.seen(i) and silent[i] > self.grace_s]

    def fail(self, decision: Decision) -> str:
        """Mark the attempt failed (this island lost a peer during it), unless it already counted;
        returns the attempt's outcome (``"fail"``, or ``"ok"`` when it counted first)."""
        return self.store.compare_set(self._k(f"{decision.key}/outcome"), "", "fail").decode()

    def settle(self, decision: Decision) -> None:
        """After this island's exchange of the attempt: wait until every member finished it (the
        attempt counts) or one was lost (:class:`RoundLost`: run the round again)."""
        self.store.set(self._k(f"{decision.key}/done/{self.island}"), "1")
        keys = {i: self._k(f"{decision.key}/done/{i}") for i in decision.present}
        outcome_key = self._k(f"{decision.key}/outcome")
        missing: list[int] = []

        def all_done() -> bool:
            if not self.store.check(list(keys.values())):
                return False
            if isinstance(self.store, SealedStore):  # a forged mark would count an attempt a member left
                self.store.multi_get(list(keys.values()))  # one request more, with a secret only
            return True

        def ready() -> str | None:
            # every member finished (the usual case): write "ok" unless "fail" is there already
            return self.store.compare_set(outcome_key, "", "ok").decode() if all_done() else None

        def scan() -> str | None:
            outcome = self._outcome(decision)
            if outcome is not None:
                return outcome
            self._check_current(decision.round)
            missing[:] = absent(self.store, keys)
            if not missing and all_done():
                return self.store.compare_set(outcome_key, "", "ok").decode()
            silent = self._silent(missing, time.monotonic())
            return self.fail(decision) if any(self._gone(i, silent[i], self._incs.get(i)) for i in missing) else None

        outcome = self._wait(decision.round, ready, scan, lambda: f"islands {missing} did not finish its exchange")
        if outcome == "ok":
            self.committed = decision
            gone = self._leaving.pop(decision.round, set())
            if gone:  # they retired with this round: no later round expects them
                self.retired |= gone
                self.roster -= gone
                self.changes.append(f"round {decision.round}: islands {sorted(gone)} retired from the run")
            if self.island in decision.joining:
                self.store.delete_key(self._k(f"join/{self.island}"))
            if self.sweeper is not None and self.island == decision.present[0] and decision.round >= KEEP_ROUNDS:
                self.sweeper.sweep(decision.round - KEEP_ROUNDS)
            return
        self._attempt[decision.round] = decision.attempt + 1
        raise RoundLost(f"round {decision.round} attempt {decision.attempt} lost an island; running it again "
                        "without it")

    def _check_ended(self, before: int | None = None) -> None:
        """Raise :class:`RunEnded` when the run ended (with a round before ``before``, if given)."""
        ended = self._get(self._k("ended"))
        if ended is not None and (before is None or int(ended) < before):
            raise RunEnded(f"the other islands ended training after round {int(ended)}")

    def _check_current(self, round_: int) -> None:
        """Raise :class:`LateForRound` when round ``round_``'s keys were deleted: the others counted a
        round at least ``KEEP_ROUNDS`` later (:mod:`lightning_islands.link.sweeper`)."""
        swept = self._get(self._k(SWEPT))
        if swept is not None and int(swept) >= round_:
            raise LateForRound(f"round {round_} is long over for the other islands (they counted round "
                               f"{int(swept) + KEEP_ROUNDS} or later)")

    def end(self, round_: int) -> None:
        """Record that the run ended with round ``round_`` (an island still trying to get back in stops)."""
        self.store.set(self._k("ended"), str(round_))

    def retry(self, decision: Decision) -> None:
        """This island's exchange of the attempt failed: mark it failed; the next :meth:`decide` of
        the round runs the next attempt."""
        self.fail(decision)
        self._attempt[decision.round] = decision.attempt + 1

    # ------------------------------------------------------------------ the roster
    def read_enrolments(self) -> None:
        """Take the enrolment log's new entries into the roster (one request when there are none)."""
        count = self.store.add(self._k("enrolled"), 0)
        todo = sorted(self._unwritten | set(range(self._enrolled + 1, count + 1)))
        self._enrolled = max(self._enrolled, count)
        for n in todo:
            raw = self._get(self._k(f"enrol/{n}"))
            if raw is None:  # counted, not written (yet: or its writer died): read again at the next round
                self._unwritten.add(n)
                continue
            self._unwritten.discard(n)
            island = int(json.loads(raw)["island"])
            if island not in self.retired:
                self.roster.add(island)

    def enroll(self) -> None:
        """Put this island on the run's roster: every decider reads it at its next round and looks for
        this island's join request from then on."""
        n = self.store.add(self._k("enrolled"), 1)
        self.store.set(self._k(f"enrol/{n}"), json.dumps({"island": self.island, "inc": self.incarnation}))
        self.roster.add(self.island)

    def retire_after(self, round_: int) -> None:
        """This island leaves the run for good once round ``round_`` counts: its header of that round
        says so, and no later round expects it."""
        self.leaving = round_

    # ------------------------------------------------------------------ rejoining
    def request_join(self, from_round: int = 0, every: int = 1) -> None:
        """Ask the live islands to take this one into a round, from round ``from_round`` on (an
        island left behind in a round is not a joiner of that round's later attempts), and only
        every ``every`` rounds from it; it enrolls, so that an island that never knew it (one that
        joined after it was lost) looks for it too."""
        self.previous = self.committed = None
        self.holds_start_lanes = False
        request = {"from": from_round, "inc": self.incarnation, **({"every": every} if every > 1 else {})}
        self._request = request
        self.store.set(self._k(f"join/{self.island}"), json.dumps(request))
        self.enroll()

    def await_inclusion(self, timeout_s: float) -> Decision:
        """Wait until a round is decided with this island joining; returns that decision (the join
        request is withdrawn, and :meth:`decide` of that round continues at its attempt)."""
        key = self._k(f"joined_at/{self.island}")

        def scan() -> Decision | None:
            self._check_ended()
            found = self._get(key)
            if found is None:
                return None
            decision = Decision.from_json(found)
            mine = dict(zip(decision.joining, decision.joining_incs)).get(self.island)
            if mine != self.incarnation or self._outcome(decision) is not None:
                return None
            if not _asks_for(self._request, decision.round):  # a decision of an earlier request, left or rewritten
                self.store.delete_key(key)
                return None
            self.store.delete_key(self._k(f"join/{self.island}"))
            self.store.delete_key(key)
            self._attempt[decision.round] = decision.attempt
            return decision

        def expired() -> QuorumLost:
            return QuorumLost(f"island {self.island} asked to rejoin but no live island took it into a round within "
                              f"{timeout_s:g} s (deadline_s); are the other islands still training?")

        return wait_until(lambda: None, scan=scan, deadline=time.monotonic() + timeout_s, expired=expired,
                          progress=self.progress, scan_s=POLL_S * 5, pause=self.pause)


def _asks_for(request: dict, round_: int) -> bool:
    """Whether a join request takes round ``round_``: from its round on, every its ``every`` rounds."""
    since = round_ - int(request["from"])
    return since >= 0 and since % max(1, int(request.get("every", 1))) == 0
