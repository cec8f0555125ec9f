"""A round's attempts: run again after losing an island, rejoined when the others went on, ended
when the run ended.

An attempt raises :class:`~lightning_islands.link.protocol.RoundLost` when an island of the round
was lost during it (the round runs again with the islands still alive),
:class:`~lightning_islands.link.protocol.LateForRound` when the round was decided without this island
(it rejoins at the next round) and :class:`~lightning_islands.link.protocol.RunEnded` when the other
islands ended training meanwhile. The same loop serves the synchronous round (every rank) and the
leader's background thread of an overlapped one. There is no count of attempts: the link bounds a
round in time (``deadline_s``, all attempts included) and ends the run past it
(:class:`~lightning_islands.link.protocol.DeadlinePassed`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from lightning_islands.link.protocol import LateForRound, RoundLost, RunEnded

T = TypeVar("T")
log = logging.getLogger(__name__)


def run_attempts(round_: int, attempt: Callable[[int], T], late: Callable[[str], T], ended: Callable[[], T],
                 leader: bool) -> T:
    """``attempt(k)`` for k = 0, 1, ... until one counts (again after :class:`RoundLost`);
    ``late(why)`` when the round went on without this island, ``ended()`` when the run ended.
    ``leader``: this rank logs the lost attempts."""
    k = 0
    while True:
        try:
            return attempt(k)
        except RoundLost as err:
            if leader:
                log.warning("islands: %s (attempt %d)", err, k + 1)
            k += 1
        except LateForRound as err:
            return late(str(err))
        except RunEnded:
            return ended()
