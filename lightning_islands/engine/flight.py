"""An overlapped round in flight: its exchange runs in a background thread of the island's leader."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class InFlight:
    """An overlapped round's exchange in a background thread on the leader: the round headers, then
    every chunk of the fragment's gathered vector encoded, exchanged, decoded and merged. It reads
    only the snapshot it was given (the gathered pseudo-gradient) and writes only its own results,
    so the inner steps that run meanwhile cannot race with it."""

    def __init__(self, work: Callable[[], dict[str, Any]], name: str) -> None:
        self.result: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.cpu_seconds = 0.0  # the thread's CPU time (time.thread_time), once it ended
        self.thread = threading.Thread(target=self._run, args=(work,), name=name, daemon=True)
        self.thread.start()

    def _run(self, work: Callable[[], dict[str, Any]]) -> None:
        started = time.thread_time()
        try:
            self.result = work()
        except BaseException as err:  # noqa: BLE001 - raised again where the round lands
            self.error = err
        finally:
            self.cpu_seconds = time.thread_time() - started

    def join(self) -> dict[str, Any]:
        """Wait for the exchange; its result, or its error raised here."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result
