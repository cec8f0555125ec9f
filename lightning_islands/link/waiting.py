"""The one way an island waits for the others: :func:`wait_until`.

Every wait of the link for keys or peers (headers, a round's decision, its outcome, a rejoin, a
start-up object) is this loop (a transfer on the lanes is watched at the same ``SCAN_S`` by
``IslandLink._watched``, which waits on the transfer thread's event instead of polling keys):
a cheap check every ``POLL_S`` (one request to the coordinator for
the keys waited for), the full scan every ``SCAN_S`` (liveness, failures, decisions made elsewhere;
over a WAN each request is a round trip, so the poll stays one request), a touch of this island's
progress at every scan (an island waiting within its deadline is alive), and a deadline past which
the wait ends with an error that names what was waited for and the fix. Nothing waits without one.
On an etcd coordinator the poll's pause is a watch (``pause``): the loop checks again when a key
of the run changed, or at the next scan, instead of every ``POLL_S``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

POLL_S = 0.01  # how often the keys waited for are checked (one request)
SCAN_S = 0.25  # how often the full scan runs (liveness, failures, decisions)


def wait_until(ready: Callable[[], T | None], *, deadline: float, expired: Callable[[], Exception],
               scan: Callable[[], T | None] | None = None, progress: Callable[[], None] | None = None,
               poll_s: float = POLL_S, scan_s: float = SCAN_S,
               pause: Callable[[float], None] | None = None) -> T:
    """Return the first value other than ``None`` of ``ready()`` (asked every ``poll_s``) or of
    ``scan()`` (asked every ``scan_s``, the first time after one ``scan_s``); either may raise to
    end the wait. ``progress()`` is called on entry (reaching a wait is progress) and at every
    scan. At ``deadline`` (a ``time.monotonic()`` time), ``expired()`` is raised. ``pause(s)``
    replaces the sleep between two polls: it may return as soon as something changed, at the
    latest after ``s`` seconds (the time left until the next scan).
    """
    if progress is not None:
        progress()
    next_scan = time.monotonic() + scan_s
    while True:
        found = ready()
        if found is not None:
            return found
        now = time.monotonic()
        if now >= next_scan:
            next_scan = now + scan_s
            if progress is not None:
                progress()
            if scan is not None:
                found = scan()
                if found is not None:
                    return found
            if time.monotonic() >= deadline:
                raise expired()
        if pause is None:
            time.sleep(poll_s)
        else:
            pause(max(0.0, min(next_scan, deadline) - time.monotonic()))


def in_thread(move: Callable[[], Any], name: str) -> tuple[threading.Event, dict[str, Any]]:
    """Start ``move()`` in a daemon thread named ``name``; returns the event it sets when it ends
    and the box that then holds its ``"result"`` or its ``"error"`` (to raise in the caller's
    thread). A transfer on the lanes runs so, watched by the caller (it may give it up)."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["result"] = move()
        except BaseException as err:  # noqa: BLE001 - raised in the caller's thread
            box["error"] = err
        done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    return done, box
