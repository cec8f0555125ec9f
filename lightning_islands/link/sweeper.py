"""Deleting what the coordinator no longer needs, off the rounds' path: :class:`Sweeper`.

A round leaves keys in the coordinator's store (every island's header, its member set, its outcome,
each member's "done"). Once a round ``KEEP_ROUNDS`` later counted, no island can need them: an island
that far behind is late (:class:`~lightning_islands.link.protocol.LateForRound`, it rejoins), which
the ``swept`` key tells it. One member of each round (its lowest) hands the old round to its
sweeper, which deletes its keys from a thread of its own on a connection of its own, so a run's
keys stay bounded however long it runs and no round waits for the deletes (over a WAN each is a
round trip).
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
from collections.abc import Callable

import torch.distributed as dist

from lightning_islands.link.lanes import START_LANES, rendezvous_keys

log = logging.getLogger(__name__)
KEEP_ROUNDS = 2  # a round's keys are deleted once the round this many later counted
SWEPT = "swept"  # the newest round whose keys are deleted


def round_keys(store: dist.Store, run_id: str, round_: int, num_islands: int, lanes: int) -> list[str]:
    """The keys round ``round_`` left, attempt by attempt while an attempt's member set is there:
    its headers, member set, outcome and "done"s, and the rendezvous keys of the lanes an attempt
    built, the leaders' and the other ranks' own (of ``lanes`` lanes; round 0 also sweeps those of
    the lanes opened at the start)."""
    keys: list[str] = []
    if round_ == 0:
        keys += rendezvous_keys(f"{run_id}/{START_LANES}/", lanes, num_islands)
        keys += _rank_lanes_keys(store, f"{run_id}/{START_LANES}", lanes, num_islands)
    attempt = 0
    while (members := _get(store, f"{run_id}/round{round_}/a{attempt}/members")) is not None:
        base = f"{run_id}/round{round_}/a{attempt}"
        keys += [f"{base}/members", f"{base}/outcome"]
        decision = json.loads(members)
        size = max([num_islands - 1, *decision["present"]]) + 1
        keys += [f"{base}/{kind}/{i}" for kind in ("h", "done") for i in range(size)]
        if decision["lanes"] == f"round{round_}/a{attempt}":  # built for this attempt's member set
            keys += rendezvous_keys(f"{base}/", lanes, len(decision["present"]))
            keys += _rank_lanes_keys(store, base, lanes, len(decision["present"]))
        attempt += 1
    return keys


def _rank_lanes_keys(store: dist.Store, base: str, lanes: int, size: int) -> list[str]:
    """The rendezvous keys of the ranks' own lanes built under ``base`` (``exchange=sliced``: rank
    ``k`` of every island builds under ``<base>/rank<k>/``, ``k = 1, 2, ...`` up to the round's
    slices); a rank whose lanes' first or last key is missing was not built, and no later one was."""
    keys: list[str] = []
    for k in itertools.count(1):
        found = rendezvous_keys(f"{base}/rank{k}/", lanes, size)
        if not found or not (store.check(found[:1]) or store.check(found[-1:])):
            return keys
        keys += found
    return keys


def _get(store: dist.Store, key: str) -> bytes | None:
    return store.get(key) if store.check([key]) else None


class Sweeper:
    """Deletes old rounds' keys from a thread with its own store connection (``connect``).

    :meth:`sweep` queues a round and returns at once; :meth:`stop` ends the thread (a sweep under
    way finishes first). ``swept`` is the newest round deleted so far.
    """

    def __init__(self, connect: Callable[[], dist.Store], run_id: str, num_islands: int | Callable[[], int],
                 lanes: int, name: str) -> None:
        self.connect, self.run_id, self.num_islands, self.lanes = connect, run_id, num_islands, lanes
        self.swept = -1
        self._rounds: queue.Queue[int | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def sweep(self, round_: int) -> None:
        """Delete round ``round_``'s keys (and any earlier round's not deleted yet), soon."""
        self._rounds.put(round_)

    def stop(self) -> None:
        """End the thread once the queued sweeps are done (waits a few seconds at most)."""
        self._rounds.put(None)
        self._thread.join(timeout=10.0)

    def _run(self) -> None:
        store: dist.Store | None = None
        while (round_ := self._rounds.get()) is not None:
            try:
                store = store or self.connect()
                store.set(f"{self.run_id}/{SWEPT}", str(round_))  # before the keys go: a late island knows
                for r in range(max(self.swept + 1, 0), round_ + 1):
                    n = self.num_islands() if callable(self.num_islands) else self.num_islands
                    for key in round_keys(store, self.run_id, r, n, self.lanes):
                        store.delete_key(key)
                self.swept = max(self.swept, round_)
            except Exception as err:  # noqa: BLE001 - a sweep is best effort: the keys wait for the next one
                log.info("lightning_islands: could not delete round %d's keys (%s); trying with the next", round_, err)
                store = None
