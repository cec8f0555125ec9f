"""An overlapped round with ``exchange=sliced``: every rank moves its slices in a thread of its own.

Through the leader (:mod:`.flight`) the island gathers the fragment to rank 0 and only rank 0's
thread talks to the other islands. Sliced, every owner moves its own slice, so every rank runs the
round's attempts (:func:`~lightning_islands.engine.attempts.run_attempts`) in a background thread,
on its shards of what the island sends (computed at the sync point, untouched by training), as the
synchronous round runs them: the
headers through the leader, every chunk through :func:`~lightning_islands.engine.sliced.exchange_sliced`,
then the settling. The thread's island collectives (the plan's broadcast, each chunk's all-to-all,
the slices' outcome) go over a second group of the island's ranks
(:meth:`~lightning_islands.engine.group.IslandGroup.split`), beside the training's and never
interleaved with them. Every rank's thread ends the same way (the leader's decisions reach the
others through that group), so landing the round is a join on every rank: the merged
pseudo-gradient is already in this rank's shards, and the residual is copied into the outer state.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_islands.engine.attempts import run_attempts
from lightning_islands.engine.flight import InFlight, Landed, catch_up
from lightning_islands.engine.group import IslandGroup
from lightning_islands.engine.header import RoundHeader
from lightning_islands.engine.island import RERAISED
from lightning_islands.engine.sliced import ERROR_KINDS

_KINDS = {**RERAISED, **ERROR_KINDS}  # errors raised on every rank as they are

if TYPE_CHECKING:
    from lightning_islands.engine.round import IslandEngine, PendingRound


def fly(engine: IslandEngine, pending: PendingRound, sent: Sequence[Tensor], delta_sq: float,
        header: RoundHeader) -> InFlight:
    """Every rank: start the round of ``header`` in a background thread on ``sent`` (this rank's
    shards of the pseudo-gradient plus decayed residual: the round's own tensors, which no inner step
    writes, so they are the snapshot); a round that loses an island runs again without it, as the
    synchronous one does."""
    side, fragment, meeting = engine.flight_side(), pending.fragment, engine.meeting
    layout = copy.copy(engine.fragment_layouts[fragment])
    layout.group = side.group  # the same pieces, moved over the second group
    idx = engine.state.indices(fragment)
    anchors = [engine.state.anchors[i] for i in idx]  # the results' shapes (the anchors change only at landing)
    residual = None if engine.state.residual is None else [torch.empty_like(engine.state.residual[i]) for i in idx]

    def attempt(first: RoundHeader, k: int) -> dict[str, Any]:
        this = replace(first, attempt=k)
        box: dict[str, Any] = {}
        headers = side.agree(lambda: box.setdefault("plan", meeting.meet(this)).headers)
        plan = box.get("plan") or meeting.plan(headers)
        if pending.mix is not None:  # the butterfly's group; its repairs wait for the landing
            pending.mix.arrange(headers, plan, engine.island)
        if not plan.stepped:
            side.agree(lambda: meeting.settle(this.round, plan.stop))
            return {"headers": headers}
        grads, metrics = engine._exchange_sliced(sent, delta_sq, plan, layout, anchors, residual, pending.mix, side)
        side.agree(lambda: meeting.settle(this.round, plan.stop))
        if side.is_leader:  # waiting in flight was not idle time (training went on), as the leader path says
            metrics |= plan.expert_gap_metrics()
            if engine.settings.max_staleness:
                metrics |= plan.staleness_metrics(engine.island)
            in_flight = metrics.get("islands/seconds_waiting", 0.0)
            meeting.totals["seconds_waiting"] -= in_flight
            metrics["islands/seconds_waiting_in_flight"] = metrics.pop("islands/seconds_waiting", in_flight)
        return {"headers": headers, "grads": grads, "residual": residual, "metrics": metrics}

    def attempts(first: RoundHeader) -> dict[str, Any]:
        return run_attempts(
            first.round, lambda k: attempt(first, k), lambda why: {"headers": [], "late": why},
            lambda: {"headers": [RoundHeader.absent_from(first.round, stop=True)], "ended": True}, side.is_leader)

    def rejoin(from_round: int, every: int) -> int:
        return side.with_link(lambda link: link.rejoin(engine.settings.deadline_s * (every + 1), from_round, every))

    # every rank's thread learns alike that the island was late (the leader's error, raised on every
    # rank by the group), and rejoins with the others (the leader's answer, through the group)
    return InFlight(lambda: catch_up(attempts(header), header, rejoin, attempts, engine.settings,
                                     engine.island, side.is_leader),
                    name=f"island{engine.island}-rank{engine.group.rank}-round{header.round}")


def receive(work: InFlight, group: IslandGroup, residual: list[Tensor] | None) -> Landed:
    """Every rank: wait for its own thread of the round, and learn over the island's ``group``
    whether every rank's ended well (an error on any rank is raised on every rank, as the leader's
    would be); its shards of the merged pseudo-gradient and, into ``residual`` (this rank's shards
    of the outer state's; ``None``: no error feedback), what the codec dropped."""
    t0 = time.perf_counter()
    mine: BaseException | None = None
    try:
        got = work.join()
    except Exception as err:  # noqa: BLE001 - the island decides together (below)
        mine = err
    outcomes = group.all_gather_object(None if mine is None else (type(mine).__name__, str(mine)))
    failed = next(((r, o) for r, o in enumerate(outcomes) if o is not None), None)
    if mine is not None:
        raise mine
    if failed is not None:
        r, (kind, message) = failed
        raise _KINDS.get(kind, RuntimeError)(f"rank {r}'s overlapped round failed: {message}")
    landed = Landed(got["headers"], time.perf_counter() - t0, got.get("late"), bool(got.get("ended")),
                    got.get("joined"))
    if landed.late or landed.ended or "grads" not in got:
        return landed
    landed.grads = got["grads"]
    if residual is not None:
        for into, new in zip(residual, got["residual"]):
            into.copy_(new)
    landed.metrics = dict(got.get("metrics", {}))
    return landed
