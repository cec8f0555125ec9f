"""A rank's own lanes to its counterparts in the other islands: :class:`RankLanes`.

The sliced exchange (``islands.exchange=sliced``) has rank ``r`` of every island move slice ``r``
of the fragment; rank 0's lanes are its island's :class:`~lightning_islands.link.island_link.IslandLink`,
the other ranks' are these. They hold no membership of their own: the island's leader decides each
round's members and hands them over (:meth:`RankLanes.use`), and the lanes of a member set are built
under the leader's lanes key with the rank's number appended, so rank ``r`` of every island present
meets the same groups. A transfer is watched as the leader's are, by its size: past twice
``grace_s`` plus :data:`~lightning_islands.link.island_link.MARGIN` times its bytes at the slowest
rate measured, it is given up (its groups retired) and :class:`RoundLost` tells the island, whose
leader then marks the attempt failed for every island. A peer that dies resets its connections and
fails the transfer at once. One that goes silent is noticed by the leaders, whose links watch the
islands' liveness: the first to notice marks the round's attempt failed at the coordinator, and a
rank's transfer watches that mark (the attempt the leader hands over with :meth:`RankLanes.use`),
so it gives up within a scan of it instead of at its own deadline; never at gloo's timeout.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch

from lightning_islands.link.coordinator import ENV_LINK_IFNAME, connector
from lightning_islands.link.island_link import FIRST_RATE_BPS, MARGIN, RATE_MIN_BYTES, RATES, STORE_TIMEOUT
from lightning_islands.link.lanes import Lanes
from lightning_islands.link.protocol import LinkStats, PayloadRefused, RoundLost
from lightning_islands.link.waiting import SCAN_S, in_thread

T = TypeVar("T")


class RankLanes:
    """Rank ``rank`` of island ``island``'s lanes to rank ``rank`` of the other islands (a
    :class:`~lightning_islands.link.protocol.RankLink`).

    Args:
        address: the coordinator's address (its store holds the lanes' rendezvous).
        island, rank: this end.
        num_islands: the length of lists in island order.
        run_id: the run's namespace at the coordinator.
        lanes: parallel groups per member set (``islands.lanes``).
        deadline: gloo's timeout of an operation (a transfer is given up well before, by its size).
        grace_s: how long a silent peer is waited for (seconds, or a callable asked each time).
        interface: the network interface the lanes bind to (default: ``LI_LINK_IFNAME``, else gloo's).
    """

    def __init__(self, address: str, island: int, rank: int, num_islands: int, run_id: str = "run", lanes: int = 2,
                 deadline: timedelta = timedelta(hours=1), grace_s: float | Callable[[], float] = 60.0,
                 interface: str | None = None) -> None:
        self.island, self.rank, self.num_islands, self.run_id = island, rank, num_islands, run_id
        connect = connector(address, min(deadline, STORE_TIMEOUT))
        self.lanes = Lanes(connect, lanes, deadline, interface or os.environ.get(ENV_LINK_IFNAME) or None,
                           f"island {island} rank {rank}")
        self._connect, self._store = connect, None  # the watch's own connection, made when first needed
        self._attempt: str | None = None  # the round's attempt whose failure mark the transfers watch
        self._grace = grace_s
        self.present: tuple[int, ...] = ()
        self._key: str | None = None
        self._built = False
        self._rates: deque[float] = deque(maxlen=RATES)
        self.stats = LinkStats()

    def __repr__(self) -> str:
        return f"RankLanes(island={self.island}, rank={self.rank})"

    def use(self, present: tuple[int, ...], lanes_key: str | None, attempt: str | None = None) -> None:
        """The round's islands present and their lanes' key; the lanes are built when it changes.
        ``attempt``: the key of the round's attempt (``round<r>/a<k>``) whose failure mark, set by
        any island's leader at the coordinator, ends this rank's transfers of it at once."""
        self._attempt = attempt
        if self._built and lanes_key == self._key and tuple(present) == self.present:
            return
        self.present, self._key, self._built = tuple(present), lanes_key, False
        if self.island not in present:
            return
        self.lanes._options()  # a bad LI_LINK_IFNAME is a RuntimeError naming it, not a lost round
        prefix = f"{self.run_id}/{lanes_key}/rank{self.rank}/"
        self._watched("building its lanes", lambda: self.lanes.build(prefix, present.index(self.island),
                                                                     len(present)))
        self._built = True

    def all_gather_bytes(self, payload: torch.Tensor, limit: int | None = None) -> list[torch.Tensor]:
        """Every island's payload of this rank's slice, in island order (empty for an island not
        present); sizes outside ``0..limit`` are :class:`PayloadRefused` before allocation."""
        payload = _checked(payload)
        out = [torch.empty(0, dtype=torch.uint8) for _ in range(self.num_islands)]
        out[self.island] = payload
        present = self.present
        if present == (self.island,):
            return out
        got = self._transfer("an all-gather", present, lambda: self.lanes.sizes(payload.numel()),
                             lambda sizes: self.lanes.all_gather(payload, sizes), payload.numel(), limit)
        for i, t in zip(present, got):
            out[i] = t
        return out

    def swap_bytes(self, payload: torch.Tensor, peers: Sequence[int], limit: int | None = None
                   ) -> dict[int, torch.Tensor]:
        """Send this rank's payload to the same rank of each island of ``peers`` present and receive
        each one's (the butterfly's pairs, :meth:`Link.swap_bytes`); sizes refused as in
        :meth:`all_gather_bytes`."""
        payload = _checked(payload)
        present = self.present
        islands = [i for i in peers if i in present and i != self.island]
        if not islands:
            return {}
        ranks = [present.index(i) for i in islands]
        got = self._transfer("a swap", islands, lambda: self.lanes.swap_sizes(payload.numel(), ranks),
                             lambda sizes: self.lanes.swap(payload, ranks, sizes), payload.numel(), limit)
        return dict(zip(islands, got))

    def _transfer(self, what: str, islands: Sequence[int], sizes_of: Callable[[], list[int]],
                  move: Callable[[list[int]], list[torch.Tensor]], sent: int, limit: int | None) -> list[torch.Tensor]:
        """A watched transfer among ``islands`` (in the order of ``sizes_of()``'s answer): the sizes
        first, refused outside ``0..limit`` before anything is allocated, then ``move(sizes)``."""
        if not self._built:
            raise RoundLost(f"rank {self.rank} of island {self.island} has no lanes for this round (they were not "
                            "built: RankLink.use was not called, or failed)")
        t0 = time.perf_counter()
        sizes = self._watched(f"{what}'s sizes", sizes_of)
        bad = {i: n for i, n in zip(islands, sizes) if i != self.island and (n < 0 or limit is not None and n > limit)}
        if bad:
            raise PayloadRefused(f"rank {self.rank} of island {self.island}: island(s) {sorted(bad)} announced "
                                 f"{sorted(bad.values())} bytes for a slice, outside 0..{limit}; refused before "
                                 "allocating")
        t1 = time.perf_counter()
        incoming = sum(n for i, n in zip(islands, sizes) if i != self.island)
        got = self._watched(what, lambda: move(sizes), incoming)
        self.stats.seconds_waiting += t1 - t0
        self.stats.seconds_exchanging += time.perf_counter() - t1
        self.stats.bytes_sent += sent * sum(1 for i in islands if i != self.island)
        self.stats.bytes_received += incoming
        return got

    def _watched(self, what: str, move: Callable[[], T], nbytes: int = 0) -> T:
        """``move()`` in a thread of its own, given up past its deadline (module docstring)."""
        grace = self._grace() if callable(self._grace) else self._grace
        rate = min(self._rates) if self._rates else FIRST_RATE_BPS / 8
        started = time.monotonic()
        limit = 2 * grace + MARGIN * nbytes / rate
        done, box = in_thread(move, f"island{self.island}-rank{self.rank}-{what.split()[-1]}")
        why = None
        while why is None and not done.wait(SCAN_S):
            if self._failed_elsewhere():
                why = f"round attempt {self._attempt} failed on another island"
            elif time.monotonic() - started > limit:
                why = (f"it took longer than its deadline of {limit:.1f} s ({nbytes} bytes at {rate * 8 / 1e6:.3g} "
                       f"Mbit/s with a margin of {MARGIN:g}, plus twice grace_s)")
                self._rates = deque([rate / 2], maxlen=RATES)
        if why is not None:
            self._built = False  # the next round's lanes are built anew
            self.lanes.retire(done)
            raise RoundLost(f"rank {self.rank} of island {self.island} gave up {what}: {why}")
        if "error" in box:
            err = box["error"]
            if isinstance(err, RuntimeError) and not isinstance(err, (RoundLost, PayloadRefused)):
                self._built = False
                raise RoundLost(f"rank {self.rank} of island {self.island} lost a peer during {what} ({err})") from err
            raise err  # type: ignore[misc]
        if nbytes >= RATE_MIN_BYTES:
            self._rates.append(nbytes / max(time.monotonic() - started, 1e-9))
        return box["result"]  # type: ignore[return-value]

    def _failed_elsewhere(self) -> bool:
        """Whether the current attempt is marked failed at the coordinator (read without checking a
        seal: a forged mark can only make this rank give up a transfer, as withholding could)."""
        if self._attempt is None:
            return False
        key = f"{self.run_id}/{self._attempt}/outcome"
        try:
            self._store = self._store or self._connect()
            return bool(self._store.check([key])) and self._store.get(key).endswith(b"fail")
        except Exception:  # noqa: BLE001 - the coordinator unreachable: the deadline still bounds the wait
            self._store = None
            return False

    def take_stats(self) -> LinkStats:
        """Bytes and seconds moved since the last call."""
        stats, self.stats = self.stats, LinkStats()
        return stats

    def close(self) -> None:
        """Release the lanes."""
        self.lanes.close()


def _checked(payload: torch.Tensor) -> torch.Tensor:
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise TypeError("payload must be a 1-D uint8 tensor")
    return payload.cpu().contiguous()
