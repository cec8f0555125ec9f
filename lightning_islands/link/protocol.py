"""What the engine and the strategy may ask of the link between islands, and how it fails.

:class:`Link` is the whole interface of an island's connection to the other islands: the engine
and the Lightning strategy import this module of the package and nothing else.
:class:`~lightning_islands.link.island_link.IslandLink` is the real one (a coordinator store and gloo
lanes), :class:`~lightning_islands.link.auth.AuthenticatedLink` wraps any Link with MACs, and the
tests' ``MemoryLink`` is a double. The errors say what happened to a round or to the run, so the
engine can run a round again, rejoin, or end with a message that names the cause.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


class RoundLost(RuntimeError):
    """An island of the round was lost during it: the round runs again without it."""


class LateForRound(RuntimeError):
    """The round was decided without this island (it arrived after the grace window): it rejoins."""


class QuorumLost(RuntimeError):
    """Fewer than ``min_islands`` islands are alive: training cannot go on."""


class RunEnded(RuntimeError):
    """The other islands ended training (an agreed last round) before this one got back in."""


class IslandAborted(RuntimeError):
    """Another island reported a failure (or never arrived) while this one waited for it."""


class DeadlinePassed(IslandAborted):
    """A round (or the start) did not finish within its deadline (``deadline_s``): the run ends,
    naming the islands it waited for and the fix."""


class CoordinatorLost(ConnectionError):
    """The coordinator stopped answering: the run cannot go on (restart it from the last checkpoints)."""


class AuthenticationError(RuntimeError):
    """An island's payload or object did not carry a valid MAC: altered on the way, or sent by a
    process with a different secret or none."""


class PayloadRefused(RuntimeError):
    """An island announced a payload size no honest island sends (negative, or above what the
    codec produces for the chunk): refused before anything is allocated for it."""


@dataclass
class LinkStats:
    """Bytes and seconds a link moved since its last :meth:`Link.take_stats`."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds_exchanging: float = 0.0
    seconds_waiting: float = 0.0


class Link(Protocol):
    """The leader's connection to the other islands."""

    island: int
    num_islands: int  # the length of lists in island order (one more than the highest island present)
    present: tuple[int, ...]  # the islands of the current round (all of them before the first)
    roster: tuple[int, ...]  # the run's islands as this one knows them: started or joined, not retired
    lanes_key: str | None  # changes whenever the lanes are rebuilt for another member set

    def open_lanes(self) -> None:
        """Open the streams payloads travel on (after the fingerprints agreed)."""
        ...

    def meet_round(self, round_: int, header: dict) -> list[dict | None]:
        """Every island's header of round ``round_`` in island order (``None``: not present), in the
        wire form this island sends (:meth:`~lightning_islands.engine.header.RoundHeader.to_wire`);
        the member set is decided here (:mod:`lightning_islands.link.membership`). Raises
        :class:`LateForRound` when the round went on without this island, :class:`QuorumLost`."""
        ...

    def settle_round(self) -> None:
        """This island finished the round's exchange: return once the round counts for every
        member, or raise :class:`RoundLost` (run it again)."""
        ...

    def end_run(self, round_: int) -> None:
        """Round ``round_`` was the run's last (an island still rejoining stops)."""
        ...

    def retire_after(self, round_: int) -> None:
        """This island leaves the run for good once round ``round_`` counts: no later round expects it."""
        ...

    def publish(self, key: str, obj: object) -> None:
        """Publish the JSON-able ``obj`` under ``key`` for islands that join later."""
        ...

    def read_object(self, key: str, timeout_s: float) -> object:
        """The object published under ``key``, once it is there (within ``timeout_s``)."""
        ...

    def rejoin(self, timeout_s: float, from_round: int = 0, every: int = 1) -> int:
        """A restarted (or late) island asks to be taken back; the round it is taken into
        (:class:`RunEnded` when the run ended first): one of ``from_round``, ``from_round + every``,
        ... (a late island's snapshot of one fragment joins that fragment's next round)."""
        ...

    def membership_changes(self) -> list[str]:
        """The member-set changes seen since the last call (for the log)."""
        ...

    def gather_objects(self, key: str, obj: object) -> list:
        """Every island's JSON-able ``obj`` under ``key``, in island order."""
        ...

    def all_gather_bytes(self, payload: Tensor, limit: int | None = None) -> list[Tensor]:
        """Every island's 1-D uint8 payload, in island order (:class:`RoundLost` when a peer is lost).
        ``limit``: the most bytes an island may send (:class:`PayloadRefused` above it, or below 0)."""
        ...

    def broadcast_bytes(self, payload: Tensor | None, src: int = 0, limit: int | None = None) -> Tensor:
        """Island ``src``'s uint8 payload on every island (``limit``: as :meth:`all_gather_bytes`)."""
        ...

    def swap_bytes(self, payload: Tensor, peers: Sequence[int], limit: int | None = None) -> dict[int, Tensor]:
        """Send the 1-D uint8 ``payload`` to each island in ``peers`` and receive one from each (every
        peer calls it naming this island among its own); returns them by island. Only the islands
        named take part: the butterfly's groups swap at once, each among itself. ``limit``: as
        :meth:`all_gather_bytes`; :class:`RoundLost` when a peer is lost."""
        ...

    def take_stats(self) -> LinkStats:
        """Bytes and seconds moved since the last call."""
        ...

    def fail_round(self, why: str) -> RoundLost | DeadlinePassed:
        """A transfer of another of this island's ranks failed in the current round (``why``): the
        attempt is marked failed, so that every island runs the round again; returns the error to raise
        (:class:`DeadlinePassed` past the round's deadline)."""
        ...

    def add_wait(self, seconds: float) -> None:
        """Count ``seconds`` as time spent waiting for other islands."""
        ...

    def heartbeat(self, status: dict) -> None:
        """Publish this island's status (the launcher shows it); it must change as the island
        advances, since waiting islands read a change as progress."""
        ...

    def beating(self, status: dict, period: float | None = None) -> AbstractContextManager[None]:
        """Keep this island's status changing from a background thread while a long step without
        training steps runs (a checkpoint write)."""
        ...

    def abort(self, message: str) -> None:
        """Tell the other islands that this one failed."""
        ...

    def close(self) -> None:
        """Stop beating and release the connections."""
        ...


class RankLink(Protocol):
    """One rank's lanes to the rank of the same number in every other island: the sliced exchange's
    (rank 0's are its island's :class:`Link`). The island's leader decides each round's members;
    :meth:`use` hands them to the other ranks before their transfers."""

    def use(self, present: tuple[int, ...], lanes_key: str | None, attempt: str | None = None) -> None:
        """The round's islands present and the key their lanes are built under (as the leader's link
        has them); lanes are rebuilt when the key changes. ``attempt``: the round attempt's key, whose
        failure (marked by any island) ends this rank's transfers of it."""
        ...

    def all_gather_bytes(self, payload: Tensor, limit: int | None = None) -> list[Tensor]:
        """As :meth:`Link.all_gather_bytes`, among this rank's counterparts of the islands present."""
        ...

    def swap_bytes(self, payload: Tensor, peers: Sequence[int], limit: int | None = None) -> dict[int, Tensor]:
        """As :meth:`Link.swap_bytes`, with this rank's counterparts of ``peers`` (the butterfly's)."""
        ...

    def take_stats(self) -> LinkStats:
        """Bytes and seconds moved since the last call."""
        ...

    def close(self) -> None:
        """Release the lanes and the coordinator connections."""
        ...
