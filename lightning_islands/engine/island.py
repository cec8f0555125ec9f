"""One rank's place among the islands: which island it is, its island's ranks, and the leader's link.

Only an island's leader (rank 0) talks to other islands. :meth:`Island.agree` is how the others
learn what it found: the leader does the work, every rank of the island gets the result, or the
error, so no rank is left waiting in a collective when the leader fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import suppress
from typing import Any, TypeVar

from lightning_islands.engine.group import IslandGroup
from lightning_islands.link.protocol import CoordinatorLost, IslandAborted, LateForRound, Link, RoundLost, RunEnded

T = TypeVar("T")
# errors of the leader that every rank re-raises as they are, with no failure report to the other
# islands: the round is run again, or rejoined; or the coordinator a report would go through is gone
RERAISED = {cls.__name__: cls for cls in (RoundLost, LateForRound, RunEnded, CoordinatorLost)}


log = logging.getLogger(__name__)


class Island:
    """This rank's island among ``num_islands``: its index, its ranks (``group``) and, on the leader
    once the islands have met, the ``link`` to the others."""

    def __init__(self, index: int, num_islands: int, group: IslandGroup) -> None:
        self.index, self.num_islands, self.group = index, num_islands, group
        self.link: Link | None = None

    @property
    def is_leader(self) -> bool:
        """Whether this rank is its island's leader (the one that talks to other islands)."""
        return self.group.rank == 0

    def agree(self, leader_work: Callable[[], T]) -> T:
        """Run ``leader_work`` on the leader; every rank of the island gets its result, or its error.

        A failure on the leader is re-raised on every rank (and reported to the other islands),
        instead of leaving the island's other ranks waiting in a collective.
        """
        box: tuple[str, Any] = ("ok", None)
        if self.is_leader:
            try:
                box = ("ok", leader_work())
            except tuple(RERAISED.values()) as err:  # not a failure to report: no abort
                box = (type(err).__name__, str(err))
            except Exception as err:  # noqa: BLE001 - forwarded to every rank below
                message = f"island {self.index}: {type(err).__name__}: {err}"
                log.error("lightning_islands: island %d's leader failed", self.index, exc_info=True)  # its traceback
                if self.link is not None and not isinstance(err, IslandAborted):
                    with suppress(Exception):
                        self.link.abort(message)
                box = ("error", message)
        box = self.group.broadcast_object(box)
        if box[0] == "error":
            raise RuntimeError(box[1])
        if box[0] in RERAISED:
            raise RERAISED[box[0]](box[1])
        return box[1]

    def with_link(self, work: Callable[[Link], T]) -> T:
        """:meth:`agree` on ``work(link)`` (the leader's link to the other islands): every rank gets
        the result."""
        return self.agree(lambda: work(self.link))  # type: ignore[arg-type]  # set on the leader once met

    def on_leader(self, work: Callable[[Link], T]) -> T | None:
        """:meth:`agree` on ``work(link)`` whose result stays on the leader (``None`` on the other
        ranks, which only learn that it succeeded): for tensors no other rank needs."""
        box: list[T] = []
        self.agree(lambda: box.append(work(self.link)))  # type: ignore[arg-type]
        return box[0] if box else None
