"""An island's signs of life at the coordinator: its liveness beat and its status beats.

One notion of alive: progress. :class:`Beat` changes the island's liveness key from a thread with
its own store connection, at most every ``BEAT_S``, and only when the island made progress since
the last change (:meth:`Beat.touch`: a training or validation step, a wait or a transfer of the link
that is within its deadline, a checkpoint write in :func:`beating`); the other islands read a key
that stops changing for ``grace_s`` as a lost island (:mod:`lightning_islands.link.membership`). So
an island whose training thread is deadlocked, whose process is stopped or whose link is down
counts as silent after ``grace_s``, whichever it is. Until the island's first round counts
(:meth:`Beat.settle`: start-up, compilation, the first steps) the beat changes while the process
runs. A beat that fails (the coordinator unreachable for a moment, a connection reset) is logged
and retried on a new connection with exponential backoff, so one failed ``set`` never makes a live
island look dead for good. :func:`beating` also keeps the island's status key changing while a long
step without training runs, for the launcher to show.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)
BEAT_S = 0.25  # how often an island's liveness beat changes while its link is open
BACKOFF_MAX_S = 5.0  # the longest pause between two tries of a failing beat
CONNECT_S = 5.0  # how long a beat's (re)connection may take; stopping the beat waits at most this
LOG_EVERY_S = 60.0  # a beat that keeps failing is logged again this often

_BEATING: weakref.WeakSet = weakref.WeakSet()  # beats and status publishers whose thread runs


@atexit.register
def _stop_beats() -> None:
    """Stop every liveness thread before the interpreter finalizes (a thread inside the store's C++
    code at that moment aborts the process)."""
    for beat in list(_BEATING):
        beat.stop()


def connector(host: str, port: int, timeout: timedelta) -> Callable[[], dist.Store]:
    """A function that opens a new client connection to the TCPStore coordinator at ``host:port``
    (:func:`lightning_islands.link.coordinator.connector`, which also opens etcd clients)."""
    from lightning_islands.link.coordinator import connector as any_connector

    return any_connector(f"{host}:{port}", timeout, connect_s=CONNECT_S)


class Beat:
    """This island's liveness beat: ``key`` reads ``"INCARNATION:COUNT"``, the count (from the wall
    clock's milliseconds at the start) advancing by one at most every ``period`` seconds from a
    thread of its own (started here, stopped by :meth:`stop`):
    every period until :meth:`settle`, then only after a :meth:`touch` (progress).

    ``connect`` opens the thread's own store connection (:func:`connector`). When a ``set`` or a
    connection fails, the failure is logged with its cause and the beat tries again on a new
    connection after ``period``, doubling the pause up to ``BACKOFF_MAX_S``; the first beat that
    goes through again is logged too. ``failures`` counts the failed tries.
    """

    def __init__(self, connect: Callable[[], dist.Store], key: str, incarnation: int, name: str,
                 period: float = BEAT_S) -> None:
        self.connect, self.key, self.incarnation, self.period = connect, key, incarnation, period
        self.failures = 0
        self.progress = 0  # touches so far
        self.settled = False  # from the first round that counted on: the count follows progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _BEATING.add(self)

    def touch(self) -> None:
        """This island made progress: the next beat advances the count."""
        self.progress += 1

    def settle(self) -> None:
        """The island's first round counted: from now on the count advances only with progress."""
        self.settled = True

    def stop(self) -> None:
        """Stop beating (waits for the thread, at most a connection attempt's length)."""
        self._stop.set()
        self._thread.join(timeout=CONNECT_S + 1.0)

    def stop_with(self, owner: object) -> None:
        """Stop beating, without waiting, once ``owner`` (the link this beat belongs to) is garbage:
        a link dropped without :meth:`stop` must not beat, or retry a vanished coordinator, forever."""
        weakref.finalize(owner, self._stop.set)

    def _run(self) -> None:
        store: dist.Store | None = None
        # the count starts at the wall clock's milliseconds: a later beat of this incarnation (a new
        # link for a second fit) reads higher, and only a higher beat counts as progress
        count, pause, failing_since, logged, beaten = time.time_ns() // 1_000_000, self.period, 0.0, 0.0, -1
        while not self._stop.is_set():
            try:
                progress = self.progress
                if not self.settled or progress != beaten:
                    if store is None:
                        store = self.connect()
                    store.set(self.key, f"{self.incarnation}:{count + 1}")
                    count, beaten = count + 1, progress
            except Exception as err:  # noqa: BLE001 - logged, and tried again on a new connection
                store, self.failures = None, self.failures + 1
                now = time.monotonic()
                failing_since = failing_since or now
                if now - logged >= LOG_EVERY_S:
                    logged = now
                    log.warning("lightning_islands: the liveness beat %r failed (%s: %s); retrying on a new "
                                "connection, at most every %g s", self.key, type(err).__name__, err, BACKOFF_MAX_S)
                pause = min(BACKOFF_MAX_S, pause * 2)
            else:
                if failing_since:
                    log.warning("lightning_islands: the liveness beat %r goes through again after %.1f s",
                                self.key, time.monotonic() - failing_since)
                failing_since, logged, pause = 0.0, 0.0, self.period
            self._stop.wait(pause)


class StatusPublisher:
    """Writes an island's latest status to ``key`` from a thread of its own (with its own store
    connection, ``connect``), so that the training thread never waits a round trip to the
    coordinator for it (at 100 ms, a synchronous write every half second would cost a fifth of a
    fast step's time). Only the newest status is written; one that fails is logged (at most every
    ``LOG_EVERY_S``) and the next goes out on a new connection."""

    def __init__(self, connect: Callable[[], dist.Store], key: str, name: str) -> None:
        self.connect, self.key = connect, key
        self.failures = 0
        self._latest: str | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _BEATING.add(self)  # stopped before the interpreter finalizes, as the beats are

    def publish(self, status: str) -> None:
        """Write ``status`` soon (replacing one not written yet); returns at once."""
        with self._lock:
            self._latest = status
        self._wake.set()

    def stop(self, wait: bool = True) -> None:
        """Stop the thread after it writes the status still pending, if any (``wait``: for it, at
        most a connection attempt's length)."""
        self._stop.set()
        self._wake.set()
        if wait:
            self._thread.join(timeout=CONNECT_S + 1.0)

    def _run(self) -> None:
        store: dist.Store | None = None
        logged = 0.0
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                status, self._latest = self._latest, None
            if status is not None:
                try:
                    store = store or self.connect()
                    store.set(self.key, status)
                except Exception as err:  # noqa: BLE001 - best effort: the next status tries a new connection
                    store, self.failures = None, self.failures + 1
                    if time.monotonic() - logged >= LOG_EVERY_S:
                        logged = time.monotonic()
                        log.warning("lightning_islands: could not publish the status %r (%s: %s)", self.key,
                                    type(err).__name__, err)
            if self._stop.is_set():  # the last status published before stopping is written (once)
                return


@contextmanager
def beating(connect: Callable[[], dist.Store], key: str, status: dict, period: float,
            name: str, progress: Callable[[], None] | None = None) -> Iterator[None]:
    """Keep ``key`` (an island's status) changing from a background thread while the body runs:
    ``status`` with a ``"beat"`` that changes every ``period`` seconds, and ``progress()`` called
    as often (the island's :meth:`Beat.touch`).

    For work that takes long and cannot beat by itself (writing a checkpoint): the other islands
    see progress and keep waiting for this island, up to their round's deadline (``deadline_s``),
    the bound for a body that hangs. The thread has its own connection (``connect``) and stops when
    the body ends, also by an exception. Leaving the block waits at most a few seconds for the
    thread (a connection attempt still under way is left to end by itself: it sends nothing once
    the block has ended).
    """
    stop = threading.Event()

    def beat() -> None:
        try:  # best effort: without beats the island only looks silent
            store = connect()
        except Exception:  # noqa: BLE001
            return
        count = 0
        while not stop.wait(period):
            count += 1
            if progress is not None:
                progress()
            with suppress(Exception):  # one failed beat does not end the others
                store.set(key, json.dumps({**status, "beat": f"background {count}"}))

    thread = threading.Thread(target=beat, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=max(5.0, 2 * period))
