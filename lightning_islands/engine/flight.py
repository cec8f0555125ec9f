"""An overlapped round in flight: its exchange runs in a background thread of the island's leader.

:func:`fly` starts it, on the snapshot of the fragment's pseudo-gradient the island gathered to the
leader: the round's attempts (headers, then every chunk through the one chunk loop, then the
agreement that it counted) run in an :class:`InFlight` thread while training goes on.
:func:`receive` lands it on every rank: it waits for the thread, hands its headers (or its error)
to the island's ranks and scatters the merged pseudo-gradient and the residual back to their shards.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_islands.engine.attempts import run_attempts
from lightning_islands.engine.exchange import exchange_chunks
from lightning_islands.engine.header import RoundHeader
from lightning_islands.engine.island import Island
from lightning_islands.engine.layout import CanonicalLayout
from lightning_islands.engine.meeting import RoundMeeting
from lightning_islands.engine.settings import IslandSettings
from lightning_islands.link.protocol import RunEnded

if TYPE_CHECKING:
    from lightning_islands.engine.mixing import PendingMix

log = logging.getLogger(__name__)


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


def fly(meeting: RoundMeeting, flat: Tensor, header: RoundHeader, layout: CanonicalLayout, delta_sq: float,
        keep_residual: bool, bounds: Sequence[tuple[int, int]], mix: PendingMix | None = None) -> InFlight:
    """Leader: start the round of ``header`` in the background on ``flat`` (the fragment's gathered
    vector, laid out by ``layout``, in chunks ``bounds``); a round that loses an island runs again
    without it. ``mix``: the butterfly's round (its group mixes; its repairs wait for the landing)."""
    round_ = header.round

    def attempts(first: RoundHeader) -> dict[str, Any]:
        return run_attempts(
            first.round, lambda k: _attempt(meeting, flat, replace(first, attempt=k), layout, delta_sq, keep_residual,
                                            bounds, mix),
            lambda why: {"headers": [], "late": why},
            lambda: {"headers": [RoundHeader.absent_from(first.round, stop=True)], "ended": True}, leader=True)

    def rejoin(from_round: int, every: int) -> int:  # a round's deadline for each round it may have to wait
        return meeting.island.link.rejoin(meeting.settings.deadline_s * (every + 1), from_round,  # type: ignore
                                          every)

    return InFlight(lambda: catch_up(attempts(header), header, rejoin, attempts, meeting.settings,
                                     meeting.island.index),
                    name=f"island{meeting.island.index}-round{round_}")


def catch_up(done: dict[str, Any], header: RoundHeader, rejoin: Callable[[int, int], int],
             attempts: Callable[[RoundHeader], dict[str, Any]], settings: IslandSettings, island: int,
             leader: bool = True) -> dict[str, Any]:
    """With ``max_staleness``, an overlapped round this island was late for (``done``) is caught up
    in the thread, as the synchronous round does it (``IslandEngine._catch_up``): the island asks
    to be taken into a later round (``rejoin(from_round, every)``) and runs it with the same
    pseudo-gradient as a joiner, its work merged there as a late one; the result names the round it
    ``joined``. The snapshot is of one fragment, so with ``F`` fragments the island joins that
    fragment's next round (``F`` rounds on, or a multiple; its landing waits for it), where the
    synchronous path joins the next round with that round's fragment, taken from the parameters,
    which the thread may not touch."""
    if not done.get("late") or not settings.max_staleness:
        return done
    every = settings.rejoin_every
    try:
        joined = rejoin(header.round + every, every)
    except RunEnded:
        return {"headers": [RoundHeader.absent_from(header.round, stop=True)], "ended": True}
    if leader:
        log.warning("islands: island %d was late for round %d; it joins round %d with its work pending", island,
                    header.round, joined)
    if joined <= header.round or (joined - header.round) % every:
        raise RuntimeError(f"island {island} was taken into round {joined}, which is not a round of its snapshot's "
                           f"fragment (round {header.round} + a multiple of {every}); this is a bug: report it")
    return {**attempts(replace(header, round=joined, joining=True)), "joined": joined}


def _attempt(meeting: RoundMeeting, flat: Tensor, header: RoundHeader, layout: CanonicalLayout, delta_sq: float,
             keep_residual: bool, bounds: Sequence[tuple[int, int]], mix: PendingMix | None) -> dict[str, Any]:
    """One attempt in the background: headers, every chunk into the round's result, the settling."""
    plan = meeting.meet(header)
    if mix is not None:
        mix.arrange(plan.headers, plan, meeting.island.index)
    if not plan.stepped:
        meeting.settle(header.round, plan.stop)
        return {"headers": plan.headers}
    exchange = meeting.exchange(plan, layout, delta_sq, keep_residual) if mix is None else mix.exchange(
        meeting.codec, meeting.island.link, meeting.island.index, plan, delta_sq, keep_residual, layout)
    merged = torch.empty_like(flat)
    residual = torch.empty_like(flat) if keep_residual else None

    def keep(start: int, stop: int, got: Tensor | None, dropped: Tensor | None) -> None:
        merged[start:stop].copy_(got)  # type: ignore[arg-type]
        if residual is not None:
            residual[start:stop].copy_(dropped)  # type: ignore[arg-type]

    exchange_chunks(exchange, bounds, lambda start, stop: flat[start:stop], lambda work: work(), keep)
    meeting.settle(header.round, plan.stop)
    metrics = meeting.account(exchange, len(bounds)) | plan.expert_gap_metrics()
    if meeting.settings.max_staleness:
        metrics |= plan.staleness_metrics(meeting.island.index)
    # this thread's waits for the other islands were not idle time (training went on): the round's
    # waiting is what landing it blocks for (counted there)
    in_flight = exchange.link_sums["seconds_waiting"]
    meeting.totals["seconds_waiting"] -= in_flight
    metrics["islands/seconds_waiting_in_flight"] = metrics.pop("islands/seconds_waiting", in_flight)
    return {"headers": plan.headers, "merged": merged, "residual": residual, "metrics": metrics}


@dataclass
class Landed:
    """An overlapped round as every rank receives it: its ``headers``, and either why this island
    was ``late`` for it, that the run ``ended``, or (when some island stepped) this rank's shards of
    the merged pseudo-gradient (``grads``, on the fragment's layout) and the leader's ``metrics``;
    ``waited``: the seconds it waited for the exchange to end; ``joined``: the round it caught up in
    (:func:`catch_up`)."""

    headers: list[RoundHeader]
    waited: float
    late: str | None = None
    ended: bool = False
    joined: int | None = None  # late for its round, the island was taken into this one (max_staleness)
    grads: list[Tensor] | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def receive(island: Island, flight: InFlight | None, layout: CanonicalLayout, device: torch.device,
            residual: list[Tensor] | None) -> Landed:
    """Every rank: wait for the leader's ``flight`` (``None`` off the leader), then scatter the
    merged pseudo-gradient to this rank's shards of ``layout`` and what the codec dropped into
    ``residual`` (this rank's shards of it; ``None``: no error feedback)."""
    box: dict[str, Any] = {}
    t0 = time.perf_counter()
    headers = island.agree(lambda: (box.update(flight.join()), box["headers"])[1])  # type: ignore[union-attr]
    late, ended, joined = island.agree(lambda: (box.get("late"), box.get("ended"), box.get("joined")))
    landed = Landed(headers, time.perf_counter() - t0, late, bool(ended), joined)
    if late or ended or not any(h.steps > 0 for h in headers):
        return landed
    landed.grads = layout.scatter_from_leader(box.get("merged"), device)
    if residual is not None:
        layout.scatter_from_leader(box.get("residual"), device, into=residual)
    landed.metrics = dict(box.get("metrics", {}))
    return landed
