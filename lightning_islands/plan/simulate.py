"""The schedule as a discrete-event model (SimPy): islands step, sync, exchange and wait for each other.

Each island is a SimPy process. It takes the round's inner steps (:mod:`~lightning_islands.plan.schedule`),
reaches the sync point, forms its pseudo-gradient and starts the round's exchange as a second process:

- ``overlap_steps = 0``: the island waits for the exchange, then takes the outer step. The exchange
  gathers, encodes, sends, decodes, merges and scatters one chunk after another.
- ``overlap_steps = tau > 0``: the island first gathers the whole fragment to its leader (blocking),
  then keeps stepping while the exchange runs; after tau steps (or at the next sync point if that
  comes first) it waits for the exchange, scatters and takes the outer step.

The exchange meets the other islands twice, and these meetings are the model's events: the round
header through the coordinator's store (an island publishes its header, reads the heartbeats, then
checks the store every ``poll_s`` until every island's header is there) and the first chunk's size
all-gather. After that every island moves in step with the others, and the chunks' train is a closed
form (:meth:`~lightning_islands.plan.costs.FragmentCost.train_seconds`): each chunk's size all-gather
starts when the slowest island has finished its work between the two payloads.

The header's completion for island ``i`` that published at ``t_i``: ``max(t_i + 3 rtt, t_last + rtt +
(rtt + poll_s) / 2)`` (its own set, heartbeat read and check; or the last island's header reaching the
store, half a poll period on average, and the reply).

With ``max_staleness > 0`` the header meeting does not wait for every island: once more than half of
them (and ``min_islands``) have arrived and the first has waited ``staleness_wait_s``, else its
grace window (``grace_s``, else its round's inner steps, at least 10 s), the round goes on with
those there. An island arriving after that is late: it skips the round, joins the next one at once
without inner steps (its work merged there), and that round carries the global state to it
(anchors and outer momentum, ``8 x numel`` bytes from one island) before anyone's outer step. The
lanes rebuilt for a changed member set are not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from typing import Any

import simpy

from lightning_islands.engine.settings import GRACE_FLOOR_S
from lightning_islands.plan.costs import FP32_BYTES, FragmentCost, fragment_cost
from lightning_islands.plan.inputs import PlanInputs
from lightning_islands.plan.result import IslandResult, PlanResult
from lightning_islands.plan.schedule import round_steps

STEADY_MIN_ROUNDS = 8  # rounds measured in the steady state, at least (a whole number of fragment cycles)


class _Meeting:
    """A collective of ``n`` islands: each joins at its own time; the last one's arrival releases all of
    them at that time. With ``grace`` (island -> seconds) the meeting also goes on without the rest
    once more than half of the ``n`` (and ``min_islands``) are in and the first has waited its grace;
    :meth:`join` then answers ``None`` to a late island."""

    def __init__(self, env: simpy.Environment, n: int, grace: Callable[[int], float] | None = None,
                 min_islands: int = 1) -> None:
        self.env = env
        self.arrivals: dict[int, float] = {}
        self.n = n
        self.grace = grace
        self.min_islands = min_islands
        self.all_in = env.event()
        self._armed = False

    def join(self, now: float, island: int = -1) -> simpy.Event | None:
        if self.all_in.triggered:
            return None
        self.arrivals[island if island >= 0 else len(self.arrivals)] = now
        count = len(self.arrivals)
        if count == self.n:
            self.all_in.succeed(now)
        elif self.grace is not None and not self._armed and 2 * count > self.n and count >= self.min_islands:
            self._armed = True
            first = min(self.arrivals, key=self.arrivals.__getitem__)
            self.env.process(self._go_on(max(now, self.arrivals[first] + self.grace(first))))
        return self.all_in

    def _go_on(self, at: float) -> Generator[Any, Any, None]:
        yield self.env.timeout(at - self.env.now)
        if not self.all_in.triggered:
            self.all_in.succeed(self.env.now)


class _Model:
    """The islands' processes and what they record."""

    def __init__(self, inputs: PlanInputs, rounds: int) -> None:
        self.inputs = inputs
        self.env = simpy.Environment()
        self.n = inputs.num_islands
        self.rounds = rounds
        self.steps = round_steps(inputs, rounds)
        by_size: dict[int, FragmentCost] = {}
        self.costs = []
        for r in range(rounds):
            m = inputs.fragment_numel(r)
            if m not in by_size:
                by_size[m] = fragment_cost(inputs, m)
            self.costs.append(by_size[m])
        self.meetings: dict[tuple[str, int], _Meeting] = {}
        self.segments: list[list[tuple[float, float]]] = [[] for _ in range(self.n)]
        self.finished: list[list[float]] = [[] for _ in range(self.n)]
        self.exchange_s: list[list[float]] = [[0.0] * rounds for _ in range(self.n)]
        self.late: list[list[int]] = [[] for _ in range(self.n)]  # the rounds each island was late for
        self.catch_up_s = (2 * FP32_BYTES * inputs.numel * 8 / inputs.link.rate_bps(inputs.streams)
                           if inputs.max_staleness else 0.0)

    def grace(self, r: int, island: int) -> float:
        """How long island ``island`` waits in round ``r`` for the islands not yet arrived."""
        if self.inputs.staleness_wait_s is not None:
            return self.inputs.staleness_wait_s
        if self.inputs.grace_s is not None:
            return self.inputs.grace_s
        return max(GRACE_FLOOR_S, self.steps[r][island] * self.inputs.islands[island].step_seconds)

    def meeting(self, kind: str, r: int) -> _Meeting:
        key = (kind, r)
        if key not in self.meetings:
            if kind == "header":
                stale = self.inputs.max_staleness > 0
                self.meetings[key] = _Meeting(self.env, self.n, (lambda i: self.grace(r, i)) if stale else None,
                                              self.inputs.min_islands)
            else:  # the islands the round's header let in (a lone island meets no header)
                header = self.meetings.get(("header", r))
                self.meetings[key] = _Meeting(self.env, self.n if header is None else len(header.arrivals))
        return self.meetings[key]

    def until(self, t: float) -> simpy.Timeout:
        return self.env.timeout(max(0.0, t - self.env.now))

    def compute(self, i: int, steps: int) -> Generator[Any, Any, None]:
        if steps <= 0:
            return
        start = self.env.now
        seconds = steps * self.inputs.islands[i].step_seconds
        self.segments[i].append((start, start + seconds))
        yield self.env.timeout(seconds)

    def island(self, i: int) -> Generator[Any, Any, None]:
        env, tau = self.env, self.inputs.overlap_steps
        pending: tuple[simpy.Process, FragmentCost] | None = None
        for r in range(self.rounds):
            steps = 0 if r and r - 1 in self.late[i] else self.steps[r][i]  # late: it joins at once
            if pending is None:
                yield from self.compute(i, steps)
            else:
                first = min(tau, steps)
                yield from self.compute(i, first)
                process, cost = pending
                yield process
                yield env.timeout(cost.finish[i])
                self.finished[i].append(env.now)
                pending = None
                yield from self.compute(i, steps - first)
            cost = self.costs[r]
            yield env.timeout(cost.prep[i])  # pseudo-gradient (and, overlapped, the gather)
            process = env.process(self.exchange(i, r, cost))
            if tau == 0:
                yield process
                if r not in self.late[i]:
                    yield env.timeout(cost.finish[i])
                self.finished[i].append(env.now)
            else:
                pending = (process, cost)
        if pending is not None:
            process, cost = pending
            yield process
            yield env.timeout(cost.finish[i])
            self.finished[i].append(env.now)

    def exchange(self, i: int, r: int, cost: FragmentCost) -> Generator[Any, Any, None]:
        env, link = self.env, self.inputs.link
        start = env.now
        if self.n > 1:  # the round header through the store (a lone island has no link)
            rs = link.store_rtt
            header = self.meeting("header", r)
            went_on = header.join(env.now, i)
            if went_on is None:  # late: the round went on without it; it asks to join the next
                self.late[i].append(r)
                yield env.timeout(3 * rs)
                self.exchange_s[i][r] = env.now - start
                return
            last = yield went_on
            yield self.until(max(start + 3 * rs, last + rs + (rs + link.poll_s) / 2))
            if any(r - 1 in late for late in self.late):  # a late island joins: the state goes to it
                yield env.timeout(self.catch_up_s)
        first, final = cost.chunks[0], cost.chunks[-1]
        yield env.timeout(first.pre[i])
        last = yield self.meeting("sizes", r).join(env.now)
        yield self.until(last + cost.sizes_s + cost.train_seconds() + final.post[i])
        self.exchange_s[i][r] = env.now - start


def _overlap_seconds(segments: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in segments)


def measured_rounds(inputs: PlanInputs) -> tuple[int, int, int]:
    """``(simulated, first measured, measured)`` rounds: the whole run when ``inputs.rounds`` is set;
    else a warm-up of ``F + 2`` rounds, then whole fragment cycles (at least
    :data:`STEADY_MIN_ROUNDS` rounds), then one more round so that the last measured round's
    overlapped exchange ends inside training, not in the run's tail."""
    if inputs.rounds is not None:
        return inputs.rounds, 0, inputs.rounds
    f = inputs.fragments
    warm = f + 2
    measured = f * math.ceil(STEADY_MIN_ROUNDS / f)
    return warm + measured + 1, warm, measured


def simulate(inputs: PlanInputs) -> PlanResult:
    """Run the schedule of ``inputs`` and measure it (see :class:`~lightning_islands.plan.result.PlanResult`)."""
    total, first, count = measured_rounds(inputs)
    model = _Model(inputs, total)
    for i in range(model.n):
        model.env.process(model.island(i))
    model.env.run()
    steady = inputs.rounds is None
    rounds = range(first, first + count)
    costs = [model.costs[r] for r in rounds]
    wire_bits = [8.0 * c.wire_bytes for c in costs]
    islands, windows = [], []
    for i, spec in enumerate(inputs.islands):
        lo = model.finished[i][first - 1] if steady else 0.0
        hi = model.finished[i][first + count - 1]
        window = hi - lo
        windows.append(window)
        compute = _overlap_seconds(model.segments[i], lo, hi)
        local = sum(c.blocking[i] for c in costs) / count
        round_s = window / count
        islands.append(IslandResult(
            utilization=compute / window if window > 0 else 1.0,
            steps_per_round=compute / spec.step_seconds / count,
            round_s=round_s,
            compute_s=compute / count,
            local_s=local,
            waiting_s=max(0.0, round_s - compute / count - local),
            exchange_s=sum(model.exchange_s[i][r] for r in rounds) / count,
            leader_s=sum(c.leader_s[i] for c in costs) / count,
            late_fraction=sum(1 for r in model.late[i] if r in rounds) / count,
        ))
    window_steps = max(1, inputs.overlap_steps)
    peak = max((bits / (window_steps * spec.step_seconds) for bits in wire_bits for spec in inputs.islands),
               default=0.0)
    busy = sum(c.busy_s for c in costs)
    return PlanResult(
        islands=tuple(islands),
        devices=tuple(s.devices for s in inputs.islands),
        bytes_per_round=sum(c.wire_bytes for c in costs) / count,
        mean_bps=max(sum(wire_bits) / w for w in windows if w > 0) if any(w > 0 for w in windows) else 0.0,
        peak_bps=peak,
        link_rate_bps=inputs.link.rate_bps(inputs.streams) if model.n > 1 else 0.0,
        link_busy_fraction=max(busy / w for w in windows) if all(w > 0 for w in windows) else 0.0,
        link_s=sum(c.link_s for c in costs) / count,
        latency_s=sum(c.latency_s for c in costs) / count,
        leader_bytes=max(c.leader_bytes for c in costs),
        rounds=count,
        steady=steady,
    )
