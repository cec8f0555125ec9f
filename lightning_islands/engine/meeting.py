"""The leader's dealings with the other islands in one round: meet, exchange, settle.

:meth:`RoundMeeting.meet` publishes this island's :class:`RoundHeader` and reads everyone's (the
link decides the round's members), and derives the round's :class:`MergePlan`;
:meth:`RoundMeeting.exchange` builds the leader's :class:`ChunkExchange` for it;
:meth:`RoundMeeting.settle` waits until the round counts for every member; :meth:`RoundMeeting.account`
adds what the exchange moved to the run's totals and returns the round's metrics. Leader only:
the synchronous round calls these through the island's agreement, an overlapped round from the
leader's background thread.
"""

from __future__ import annotations

import logging
import time

from lightning_islands.codecs import Codec
from lightning_islands.engine import mixing
from lightning_islands.engine.butterfly import Butterfly
from lightning_islands.engine.exchange import LINK_TOTALS, ChunkExchange
from lightning_islands.engine.header import RoundHeader
from lightning_islands.engine.island import Island
from lightning_islands.engine.layout import CanonicalLayout
from lightning_islands.engine.merging import MergePlan
from lightning_islands.engine.settings import IslandSettings

log = logging.getLogger(__name__)


class RoundMeeting:
    """The leader's side of every round with the other islands (a lone island meets only itself).

    Args:
        island: this rank's island (its ``link`` is the leader's, once the islands have met).
        settings: the islands' settings (the weighting, the outlier ratio, error feedback).
        codec: the wire format.
        layout: the canonical layout of the whole model (expert parameters are checked against it).
    """

    def __init__(self, island: Island, settings: IslandSettings, codec: Codec, layout: CanonicalLayout) -> None:
        self.island, self.settings, self.codec, self.layout = island, settings, codec, layout
        self.butterfly = (Butterfly(island.num_islands) if settings.topology == "butterfly" and island.num_islands > 1
                          else None)
        self.totals: dict[str, float] = dict.fromkeys(LINK_TOTALS, 0.0)  # what every round moved, summed

    def meet(self, header: RoundHeader) -> MergePlan:
        """Every island's header of ``header.round``, in island order, and the merge they imply;
        the left-out islands and membership changes are logged."""
        headers, link, s = [header], self.island.link, self.settings
        if link is not None:
            t0 = time.perf_counter()
            wire = link.meet_round(header.round, header.to_wire())
            headers = [RoundHeader.from_wire(h, header.round, i) for i, h in enumerate(wire)]
            link.add_wait(time.perf_counter() - t0)
            for change in link.membership_changes():
                log.warning("islands: island %d sees membership change: %s", self.island.index, change)
        plan = self.plan(headers)
        plan.warn_left_out(s.exclude_norm_ratio)
        return plan

    def plan(self, headers: list[RoundHeader]) -> MergePlan:
        """The round's merge, as every rank of every island derives it from the headers (with the
        butterfly, each group's islands that agree on its base are the ones merged)."""
        s, agreeing, ages = self.settings, None, None
        if self.butterfly is not None:
            stage = mixing.stage_of(self.butterfly, headers[self.island.index].round, s.fragments)
            agreeing, _, ages = mixing.agreement(self.butterfly, headers, stage)
        return MergePlan.of(headers, s.weighting, s.exclude_norm_ratio, self.layout, agreeing, s.max_staleness,
                            s.staleness_decay, ages)

    def exchange(self, plan: MergePlan, layout: CanonicalLayout, delta_sq: float, keep_residual: bool) -> ChunkExchange:
        """The leader's exchange of a round with ``plan``, over the fragment laid out by ``layout``."""
        return ChunkExchange(self.codec, self.island.link, self.island.index, plan, layout, delta_sq, keep_residual)

    def settle(self, round_: int, stop: bool) -> None:
        """Wait until every member finished the round's exchange (it counts); a last round is
        recorded, so that an island still rejoining stops too."""
        link = self.island.link
        if link is None:
            return
        link.settle_round()
        if stop:
            link.end_run(round_)

    def account(self, exchange: ChunkExchange, chunks: int) -> dict[str, float]:
        """The round's metrics once its ``chunks`` moved; what the link moved joins the run's totals."""
        if self.island.link is not None:
            for key, value in exchange.link_sums.items():
                self.totals[key] += value
        link = self.island.link
        islands = len(link.roster) if link is not None else self.island.num_islands  # the run's, as it changes
        return exchange.metrics(chunks, islands, self.settings.use_error_feedback)
