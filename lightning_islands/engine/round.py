"""DiLoCo for one rank of one island: the round's sequence.

:class:`IslandEngine` owns what a round needs: the settings, the outer state, the schedule, the
codec and, through its :class:`~lightning_islands.engine.island.Island`, the link. It never sees a
LightningModule: the caller hands it this rank's local shards (``locals_``, plain tensors in
parameter order). A round, which module does each step, and on which thread:

    start (every rank)      pseudo-gradient + decayed residual; the island's tokens     round.py
                            this island's RoundHeader                                   header.py
      synchronous:          attempts until one counts                                   attempts.py
                              headers and the merge plan (leader, agreed)               meeting.py, merging.py
                              the one chunk loop: gather, exchange, scatter             exchange.py
                              the round counts (leader, agreed); state repair           meeting.py, health.py
      overlapped:           gather the snapshot; the leader's thread runs the attempts  flight.py
    finish (every rank)     an overlapped round lands first (receive, repair)           flight.py, health.py
                            the outer step on the fragment's anchors, into the shards   state.py, outer.py
                            the schedule advances; the round's metrics                  schedule.py

Before the first round the islands meet and agree on where they start (:mod:`.rendezvous`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from lightning_islands.codecs import add_residual_
from lightning_islands.engine import flight, health, mixing, outer, sliced, sliced_flight, sliced_repair
from lightning_islands.engine.attempts import run_attempts
from lightning_islands.engine.exchange import exchange_chunks
from lightning_islands.engine.flight import InFlight
from lightning_islands.engine.header import RoundHeader, StateSummary
from lightning_islands.engine.island import Island
from lightning_islands.engine.layout import CanonicalLayout
from lightning_islands.engine.lifecycle import IslandEngineBase
from lightning_islands.engine.merging import MergePlan
from lightning_islands.engine.slice_moves import slice_count
from lightning_islands.engine.stats import sum_sq
from lightning_islands.link.protocol import RoundLost, RunEnded

log = logging.getLogger(__name__)


@dataclass
class PendingRound:
    """What :meth:`IslandEngine.start` hands to :meth:`IslandEngine.finish`."""

    headers: list[RoundHeader]
    tokens: float
    step_seconds: float
    started: float
    fragment: int = 0
    grads: list[Tensor] | None = None  # the merged pseudo-gradient of this rank's shards; None: no step
    metrics: dict[str, float] = field(default_factory=dict)
    flight: InFlight | None = None  # an overlapped round's background exchange, until it lands
    experts: dict[str, list[float]] | None = None  # the island's tokens per expert in this round
    repaired: int = 0  # islands whose global state differed and was replaced at this round
    inner_steps: int = 0  # the island's inner steps when the round started
    blocking: float = 0.0  # seconds the training thread spent on an overlapped round (start and land)
    leave: bool = False  # this island retires from the run with this round (the others go on)
    late: bool = False  # the round went on without this island
    merged_tokens: float = 0.0  # the tokens of every island merged this round
    budget_spent: bool = False  # the run's max_tokens is reached with this round: every island stops
    mix: mixing.PendingMix | None = None  # the butterfly's: the stage, the proposal's optimizer, the group

    @property
    def stop(self) -> bool:
        """Whether this island stops training after this round: some island ends the run with it (so
        every island does), or this island retires with it."""
        return self.leave or self.run_ends or self.budget_spent

    @property
    def run_ends(self) -> bool:
        """Whether some island ends the run with this round."""
        return any(h.stop for h in self.headers)


class IslandEngine(IslandEngineBase):
    """The outer loop of DiLoCo on one rank of one island: the round, in two halves
    (:meth:`start`, :meth:`finish`). Its arguments are :class:`IslandEngineBase`'s."""

    in_flight: PendingRound | None = None  # an overlapped round not landed yet

    # ------------------------------------------------------------------ the round
    def run_round(self, locals_: Sequence[Tensor], experts: dict[str, list[float]] | None = None,
                  stop: bool = False, started: float | None = None) -> tuple[dict[str, float], bool]:
        """Both halves back to back: returns the round's metrics (empty when no island stepped) and
        whether the islands agreed to stop after this round."""
        pending = self.start(locals_, experts, stop, started)
        return self.finish(pending, locals_), pending.stop

    @torch.no_grad()
    def start(self, locals_: Sequence[Tensor], experts: dict[str, list[float]] | None = None,
              stop: bool = False, started: float | None = None, background: bool = False) -> PendingRound:
        """The first half (every rank of every island): pseudo-gradient, headers, exchange, merge.

        ``locals_``: this rank's local shards (of every parameter; the round takes its fragment's);
        ``experts``: this island's tokens per expert of each expert parameter (expert weighting;
        summed over the island already); ``stop``: this island ends training with this round (the
        others learn it through the headers: with ``on_end="leave"`` this island retires and they go
        on, else they stop too); ``started``: when the round began
        (``time.perf_counter()``; default now), if gathering its inputs took time.

        ``background``: overlap the round with the next inner steps. Only the fragment's snapshot is
        gathered to the leader here; the headers and the exchange run in a background thread of the
        leader, and :meth:`land` waits for them; the next round is timed from here. At most one
        round is in flight.
        """
        if self.in_flight is not None:
            raise RuntimeError("a round is still in flight: land it (IslandEngine.land) before starting the next")
        t_start = time.perf_counter() if started is None else started
        s, state = self.settings, self.state
        fragment = self.schedule.fragment
        idx, layout = state.indices(fragment), self.fragment_layouts[fragment]
        deltas = [outer.pseudo_gradient(state.anchors[i].to(locals_[i].device), locals_[i]) for i in idx]
        # the pseudo-gradient's squared norm (a plain, replicated tensor counts once: on rank 0)
        own_sq = sum_sq([d for j, d in enumerate(deltas) if layout.owns(j)])
        mix, sent = None, deltas
        if self.butterfly is not None:  # the island's own outer step, sent as its distance from the stage's base
            mix, sent = mixing.PendingMix.start(self.butterfly, state, fragment, self.schedule.round, s.fragments,
                                                deltas)
            own_sq = [own_sq, sum_sq([state.anchors[i] for j, i in enumerate(idx) if layout.owns(j)])]
        had_residual = state.residual is not None
        if s.use_error_feedback and not had_residual:
            state.residual = [torch.zeros_like(a) for a in state.anchors]
        elif s.use_error_feedback:  # each rank adds its shards of (a share of) what the last rounds dropped
            # in place: what is sent (the pseudo-gradient, or the butterfly's distance) is this round's own
            sent = [add_residual_(d, state.residual[i].to(d.device), s.error_feedback_decay) for d, i in zip(sent, idx)]
        sums = self.group.sum([*(own_sq if mix else [own_sq]), float(self.round_tokens)])
        delta_sq, tokens = sums[0], sums[-1]
        if mix is not None:
            mix.anchor_sq = sums[1]
        step_seconds = self.schedule.step_seconds(t_start)
        self._step_seconds = step_seconds
        pending = PendingRound([], tokens, step_seconds, t_start, fragment, inner_steps=self.schedule.inner_steps,
                               experts=experts, mix=mix)
        if stop and s.on_end == "leave" and self.num_islands > 1:
            pending.leave, stop, round_ = True, False, self.schedule.round
            self.side.on_leader(lambda link: link.retire_after(round_))
        header = self._header(pending, delta_sq, stop)
        if background:
            return self._fly(pending, sent, delta_sq, header)
        done = run_attempts(header.round, lambda k: self._attempt(pending, sent, delta_sq, replace(header, attempt=k),
                                                                  locals_),
                            lambda why: self._left_behind(pending, why, 0), lambda: self._ended(pending),
                            self.is_leader)
        if done.late and s.max_staleness:  # taken into the round under way, its work pending (max_staleness)
            return self._catch_up(locals_, experts, stop, pending)
        return done

    def _header(self, pending: PendingRound, delta_sq: float, stop: bool) -> RoundHeader:
        """This island's header of the round (a collective of the island: the state summary)."""
        layout = self.fragment_layouts[pending.fragment]
        tokens, experts = self._since_last_sync(pending, layout)
        norm = math.sqrt(delta_sq) if math.isfinite(delta_sq) else None
        summary = None if self.num_islands == 1 else health.state_summary(
            self.state, layout, pending.fragment, None if pending.mix is None else pending.mix.stage)
        return RoundHeader(self.schedule.round, 0, pending.fragment, tokens, self.schedule.round_steps,
                           pending.step_seconds, experts, stop, norm, summary,
                           joining=self.joining,  # a joiner's state is whatever it restarted with: repaired
                           recent=self._remember(summary), sketch=self._sketch(pending),
                           run_tokens=self.schedule.run_tokens if self.settings.max_tokens else None,
                           ranks=self.group.size)

    def _sketch(self, pending: PendingRound) -> tuple[float, ...] | None:
        """With the butterfly: the count sketch of this island's global state of the round's fragment
        (a collective of the island), from which every island estimates the islands' spread."""
        if pending.mix is None:
            return None
        idx = self.state.indices(pending.fragment)
        return tuple(self.fragment_layouts[pending.fragment].island_sketch([self.state.anchors[i] for i in idx]))

    def _remember(self, summary: StateSummary | None) -> dict[int, int] | None:
        """With ``max_staleness``: record this island's global state checksum at the fragment's step
        count (while it holds the global state) and return the last ``max_staleness + 1`` of them."""
        keep = self.settings.max_staleness
        if not keep or summary is None:
            return None
        steps = summary.fragment_steps
        recent = self.recent_states.setdefault(summary.fragment, {})
        if not self.joining:
            recent[steps] = summary.anchors
        for old in [k for k in recent if k < steps - keep]:
            del recent[old]
        return dict(recent) or None

    def _attempt(self, pending: PendingRound, sent: Sequence[Tensor], delta_sq: float, header: RoundHeader,
                 locals_: Sequence[Tensor]) -> PendingRound:
        """One attempt of a synchronous round: headers, exchange, the agreement that it counted, repair."""
        box: dict[str, MergePlan] = {}  # the leader's plan (every rank derives the same from the headers)
        pending.headers = self.side.agree(lambda: box.setdefault("plan", self.meeting.meet(header)).headers)
        plan = box.get("plan") or self.meeting.plan(pending.headers)
        if pending.mix is not None:  # the butterfly: the group, and whose base its source repairs after the mix
            pending.mix.arrange(pending.headers, plan, self.island)
        if plan.stepped:
            pending.grads, pending.metrics = self._exchange(sent, delta_sq, plan, pending.fragment, pending.mix)
            pending.metrics.update(plan.expert_gap_metrics())
            if self.settings.max_staleness:
                pending.metrics.update(plan.staleness_metrics(self.island))
            pending.merged_tokens = math.fsum(pending.headers[i].tokens for i in plan.members)
            # the run's count so far: the largest any island present reports (a late island's lags)
            self.schedule.run_tokens = max([self.schedule.run_tokens] + [
                h.run_tokens for h in pending.headers if not h.absent and h.run_tokens is not None])
            pending.budget_spent = self.schedule.spends_budget(pending.merged_tokens)
        # else every island ended exactly at a round boundary: this exchange only agreed to stop, and an
        # outer step on zero pseudo-gradients would still move the anchor by the momentum
        self.side.agree(lambda: self.meeting.settle(header.round, pending.run_ends or pending.budget_spent))
        if pending.stop:
            self.schedule.stopping = True
        self.joining = False
        # after the exchange, as an overlapped round does (a joiner's round and the others' may differ in kind)
        pending.repaired = self._repair_counted(pending.headers, locals_) if pending.mix is None else \
            self._repair_mixed(pending, locals_, 0)
        return pending

    def _exchange(self, sent: Sequence[Tensor], delta_sq: float, plan: MergePlan, fragment: int,
                  mix: mixing.PendingMix | None = None) -> tuple[list[Tensor], dict[str, float]]:
        """Every rank: the merged pseudo-gradient's part for this rank's shards of ``fragment`` (the
        outer step's gradients; with the butterfly's ``mix``, the group's mixed distance from the
        base) through the one chunk loop: each chunk of what the island sends
        (``sent``: the pseudo-gradient plus the decayed error-feedback residual) is gathered to the
        leader, exchanged, and scattered back with the new residual. The round's metrics on the leader."""
        layout, state, idx = self.fragment_layouts[fragment], self.state, self.state.indices(fragment)
        anchors = [state.anchors[i] for i in idx]
        residual = [state.residual[i] for i in idx] if state.residual is not None else None
        if self.sliced:
            return self._exchange_sliced(sent, delta_sq, plan, layout, anchors, residual, mix)
        bounds = outer.chunk_bounds(layout.numel, self.settings.exchange_chunk)
        exchange = None
        if self.is_leader:
            exchange = (self.meeting.exchange(plan, layout, delta_sq, residual is not None) if mix is None else
                        mix.exchange(self.codec, self.link, self.island, plan, delta_sq, residual is not None, layout))
        # one chunk: the scatter's own buffer becomes the gradients; several: each fills its part
        into = None if len(bounds) == 1 else [torch.zeros_like(a) for a in anchors]
        got: list[Tensor] = []

        def part(start: int, stop: int) -> Tensor | None:
            buf = exchange.take("part", stop - start, self.exchange_device) if exchange else None
            return layout.gather_to_leader(sent, self.device, self.exchange_device, start, stop, into=buf)

        def scatter(start: int, stop: int, merged: Tensor | None, dropped: Tensor | None) -> None:
            got[:] = layout.scatter_from_leader(merged, self.device, start, stop, into=into)
            if residual is not None:
                layout.scatter_from_leader(dropped, self.device, start, stop, into=residual)

        exchange_chunks(exchange, bounds, part, self.side.agree, scatter)
        grads = [g.to(a.device) for g, a in zip(got, anchors)]
        return grads, {} if exchange is None else self.meeting.account(exchange, len(bounds))

    def _exchange_sliced(self, sent: Sequence[Tensor], delta_sq: float, plan: MergePlan, layout: CanonicalLayout,
                         anchors: list[Tensor], residual: list[Tensor] | None, mix: mixing.PendingMix | None = None,
                         side: Island | None = None) -> tuple[list[Tensor], dict[str, float]]:
        """:meth:`_exchange` with every rank moving its own slice (:mod:`lightning_islands.engine.sliced`);
        with the butterfly's ``mix`` each owner swaps its slice with the partners' owners of it.
        ``side``: the island over another group of its ranks (an overlapped round's thread; ``layout``
        then on that group too)."""
        side = side or self.side
        count = slice_count(plan.headers)
        link, failed = self.rank_lanes(count, side)
        mixer = None if mix is None else (lambda lanes: mix.exchange(self.codec, lanes, self.island, plan, delta_sq,
                                                                      residual is not None, layout))
        got = sliced.exchange_sliced(side, layout, self.codec, link, plan, sent, anchors, residual, delta_sq,
                                     count, self.settings.exchange_chunk, self.device, self.exchange_device, failed,
                                     mixer)
        grads = [g.to(a.device) for g, a in zip(got.grads, anchors)]
        return grads, {} if got.exchange is None else self.meeting.account(got.exchange, got.chunks)

    def _fly(self, pending: PendingRound, sent: Sequence[Tensor], delta_sq: float, header: RoundHeader) -> PendingRound:
        """Gather the fragment's vector to the leader (an island collective, now) and start its
        exchange in the leader's background thread; the round is in flight until it lands."""
        layout = self.fragment_layouts[pending.fragment]
        if self.sliced:  # every rank's thread moves its own slices
            pending.flight = sliced_flight.fly(self, pending, sent, delta_sq, header)
        else:
            flat = layout.gather_to_leader(sent, self.device, self.exchange_device)
            if self.is_leader:
                assert flat is not None
                pending.flight = flight.fly(self.meeting, flat, header, layout, delta_sq,
                                            self.state.residual is not None,
                                            outer.chunk_bounds(layout.numel, self.settings.exchange_chunk),
                                            pending.mix)
        self.in_flight = pending
        pending.blocking = time.perf_counter() - pending.started
        self.round_tokens = 0  # the steps taken while it flies count for the next round
        self.schedule.round_steps = 0
        self.schedule.restart_clock()
        return pending

    @property
    def heading_round(self) -> int:
        """The round this island trains towards (its status says it): the next one past a round in
        flight, so that islands waiting for it (``max_staleness``) do not take it for a round behind."""
        return self.schedule.round + (self.in_flight is not None)

    def landing_due(self) -> bool:
        """Whether the round in flight has flown its ``overlap_steps`` inner steps."""
        flying = self.in_flight
        return flying is not None and self.schedule.inner_steps - flying.inner_steps >= self.settings.overlap_steps

    @torch.no_grad()
    def land(self, locals_: Sequence[Tensor]) -> tuple[dict[str, float], bool]:
        """Land the round in flight, if any (every rank): wait for its exchange, take its outer step
        and blend it into ``locals_`` (``overlap_alpha``). Returns its metrics (empty when there was
        none, or no island stepped) and whether the islands agreed to stop after it."""
        pending = self.in_flight
        if pending is None:
            return {}, False
        return self.finish(pending, locals_), pending.stop

    def _receive(self, pending: PendingRound) -> bool:
        """Wait for an overlapped round's exchange and hand its results to every rank (:func:`flight.receive`);
        whether the round counted for this island (it was not late for it, and the run did not end)."""
        work, idx = pending.flight, self.state.indices(pending.fragment)
        self.in_flight, pending.flight = None, None
        residual = None if self.state.residual is None else [self.state.residual[i] for i in idx]
        landed = (sliced_flight.receive(work, self.group, residual) if self.sliced else  # type: ignore[arg-type]
                  flight.receive(self.side, work, self.fragment_layouts[pending.fragment], self.device, residual))
        pending.headers = landed.headers
        if landed.joined is not None:  # late for its round, caught up in the one under way (max_staleness)
            self.schedule.round, self.joining = landed.joined, True
        if landed.late:
            self._left_behind(pending, landed.late, self.schedule.inner_steps - pending.inner_steps)
            return False
        if landed.ended:
            self._ended(pending)
            return False
        if pending.stop:
            self.schedule.stopping = True
        self.joining = False
        if landed.grads is None:
            return True
        pending.grads = [g.to(self.state.anchors[i].device) for g, i in zip(landed.grads, idx)]
        pending.metrics = landed.metrics
        if self.is_leader:
            pending.metrics["islands/seconds_waiting"] = landed.waited
            pending.metrics["islands/seconds_flight_cpu"] = work.cpu_seconds  # type: ignore[union-attr]
            self.totals["seconds_waiting"] += landed.waited
        return True

    @torch.no_grad()
    def finish(self, pending: PendingRound, locals_: Sequence[Tensor]) -> dict[str, float]:
        """The second half: the outer step on the fragment's anchors, written into ``locals_``
        (an overlapped round blends them with the local parameters, ``overlap_alpha``); returns the
        round's metrics (empty when no island stepped, and then nothing changes)."""
        overlapped = pending is self.in_flight
        landing = time.perf_counter()
        if overlapped:
            counted = self._receive(pending)
            if pending.mix is None:
                pending.repaired = self._repair_counted(pending.headers, locals_)
            elif counted:  # every rank learns the group from the headers; then the repairs, before the mix
                pending.mix.arrange(pending.headers, self.meeting.plan(pending.headers), self.island)
                pending.repaired = self._repair_mixed(pending, locals_, self.schedule.inner_steps - pending.inner_steps)
        if pending.grads is None:
            return {}
        idx = self.state.indices(pending.fragment)
        opt = self.state.step(pending.fragment, pending.grads) if pending.mix is None else pending.mix.land(
            self.state, pending.grads, self.island)
        pending.grads = None
        metrics = dict(pending.metrics)
        metrics.update({"islands/outer_lr": opt.lr_at(opt.steps), "islands/outer_momentum": opt.momentum_at(opt.steps)})
        self.state.write_to(locals_, idx, self.settings.overlap_alpha if overlapped else 0.0)
        self.schedule.advance(pending.tokens, pending.headers,
                              self.schedule.inner_steps - pending.inner_steps if overlapped else 0,
                              pending.merged_tokens)
        keep = self.settings.fragments - 1
        self.recent_rounds = [*self.recent_rounds, {"tokens": pending.tokens, "experts": pending.experts}][-keep:] \
            if keep else []
        if not overlapped:
            self.round_tokens = 0
        sched = self.schedule
        metrics.update({"islands/round": float(sched.round), "islands/fragment": float(pending.fragment),
                        "islands/islands_repaired": float(pending.repaired),
                        "islands/inner_steps": float(sched.inner_steps), "islands/round_tokens": pending.tokens,
                        "islands/run_tokens": float(sched.run_tokens),
                        "islands/step_seconds": pending.step_seconds,
                        "islands/steps_per_round": float(sched.steps_per_round),
                        "islands/seconds_outer_step": time.perf_counter() - pending.started})
        if overlapped:  # the training thread's share of the round, waiting included
            metrics["islands/seconds_blocking"] = pending.blocking + time.perf_counter() - landing
        metrics.update({f"islands/total_{k}": v for k, v in self.totals.items()})
        self.last_round_metrics = metrics
        return metrics

    # ------------------------------------------------------------------ islands out of step
    def _repair_counted(self, headers: Sequence[RoundHeader], locals_: Sequence[Tensor]) -> int:
        """Replace a drifted island's global state (:func:`health.repair`) once the round counted: a
        peer lost meanwhile leaves a drifted island as it was (it is repaired at its next round, not
        voting until then)."""
        try:
            if self.sliced and sliced_repair.needed(headers):  # every rank sends or takes its slice of the state
                link, failed = self.rank_lanes(slice_count(headers), self.side)
                return sliced_repair.repair_sliced(self.side, self.layout, self.state, self.device, headers, locals_,
                                                   link, self.settings.exchange_chunk, failed)
            return health.repair(self.side, self.layout, self.state, self.device, headers, locals_)
        except RoundLost as err:
            if self.is_leader:
                log.warning("islands: %s", err)
            if self.sliced:  # a rank lost its transfer: its lanes of this key are gone (see rank_lanes)
                self._broken_lanes = self._lanes_key
            self.joining = self.joining or self.island not in health.majority(headers)
            return 0

    def _repair_mixed(self, pending: PendingRound, locals_: Sequence[Tensor], steps_since: int) -> int:
        """The butterfly's repairs once the round counted (:meth:`mixing.PendingMix.repair`), before
        its mix lands. A transfer lost meanwhile: a repaired island lands no mix on a base that is not
        its group's (it skips the round; its next round of the stage repairs it), the others go on."""
        assert pending.mix is not None
        try:
            return pending.mix.repair(self, pending.headers, locals_)
        except RoundLost as err:
            if self.is_leader:
                log.warning("islands: %s", err)
            if self.sliced:  # a rank lost its transfer: its lanes of this key are gone (see rank_lanes)
                self._broken_lanes = self._lanes_key
            if self.island in pending.mix.repairs:
                self.joining, pending.grads = True, None
                self.schedule.skip(steps_since)
            return 0

    def _left_behind(self, pending: PendingRound, why: str, steps_since: int) -> PendingRound:
        """The round went on without this island (it came too late): it takes no outer step now and
        joins the next round, where the others' global state replaces its own. ``steps_since``:
        inner steps taken since the round's sync point (they count for the next round). With
        ``max_staleness`` a synchronous round is caught up instead (:meth:`_catch_up`)."""
        self.joining = True
        pending.headers, pending.grads, pending.late = [], None, True
        if self.settings.max_staleness and pending.flight is None and not steps_since:
            return pending
        if self.is_leader:
            log.warning("islands: %s; island %d rejoins at the next round", why, self.island)
        self.schedule.skip(steps_since)
        return pending

    def _catch_up(self, locals_: Sequence[Tensor], experts: dict[str, list[float]] | None, stop: bool,
                  late: PendingRound) -> PendingRound:
        """A late island with ``max_staleness`` (every rank): it asks to be taken into the round under
        way at once, without more inner steps, and runs it as a joiner: its pseudo-gradient, still
        taken from its old anchors with all its tokens since, is merged there as a late one (within
        ``max_staleness`` rounds) and it adopts the newer global state."""
        try:
            round_ = self.side.with_link(lambda link: link.rejoin(self.settings.deadline_s))
        except RunEnded:
            return self._ended(late)
        if self.is_leader:
            log.warning("islands: island %d was late for round %d; it joins round %d with its work pending",
                        self.island, self.schedule.round, round_)
        self.schedule.round = round_
        return self.start(locals_, experts, stop, late.started)

    def _ended(self, pending: PendingRound) -> PendingRound:
        """The others ended training while this island was getting back in: it stops too."""
        if self.is_leader:
            log.warning("islands: the other islands ended training; island %d stops at round %d", self.island,
                        self.schedule.round)
        self.schedule.stopping = True
        pending.headers, pending.grads = [RoundHeader.absent_from(self.schedule.round, stop=True)], None
        return pending

    @torch.no_grad()
    def rejoin(self, locals_: Sequence[Tensor]) -> tuple[dict[str, float], bool]:
        """A restarted island (every rank): ask the live islands to take it back, then run the round
        they take it into as a joiner: it receives their global parameters, outer state and round
        number, takes that round's outer step with them and ends it bit-identical to them. Returns
        the round's metrics and whether the islands agreed to stop after it."""
        bases = self.state.bases  # the butterfly's, as its checkpoint left them: a partner may still agree
        self.state.set_anchors(locals_)
        self.state.bases = bases or self.state.bases
        assert self.link is not None or not self.is_leader
        try:
            round_ = self.side.with_link(lambda link: link.rejoin(self.settings.deadline_s))
        except RunEnded:
            self.schedule.stopping = True
            return {}, True
        self.schedule.rejoin(round_)
        self.joining = True
        if self.is_leader:
            log.warning("islands: island %d rejoins the run at round %d", self.island, round_)
        # synchronous: its link sees the same calls as the others' round, overlapped or not
        return self.run_round(locals_)

    def _since_last_sync(self, pending: PendingRound, layout: CanonicalLayout
                         ) -> tuple[float, dict[str, list[float]] | None]:
        """The island's tokens, and tokens per expert of the fragment's expert parameters, since the
        fragment last synced: this round and the F - 1 before it (the merge weights)."""
        rounds = [*self.recent_rounds, {"tokens": pending.tokens, "experts": pending.experts}]
        tokens = sum(float(r["tokens"]) for r in rounds)
        if pending.experts is None:
            return tokens, None
        names = {e.name for e in layout.entries}
        experts = {}
        for name, counts in pending.experts.items():
            if name in names:
                earlier = [r["experts"][name] for r in rounds[:-1] if r.get("experts") and name in r["experts"]]
                experts[name] = [sum(c) for c in zip(counts, *earlier)]
        return tokens, experts
