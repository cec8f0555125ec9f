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
from dataclasses import replace
from typing import Any

import simpy

from lightning_islands.engine.settings import GRACE_FLOOR_S
from lightning_islands.plan.costs import FP32_BYTES, FragmentCost, fragment_cost
from lightning_islands.plan.inputs import PlanInputs
from lightning_islands.plan.result import IslandResult, PlanResult
from lightning_islands.plan.schedule import round_steps

STEADY_MIN_ROUNDS = 8  # rounds measured in the steady state, at least (a whole number of fragment cycles)
STEADY_STALE_ROUNDS = 60  # with max_staleness: enough rounds for the cycles of a late island to average out


class _Meeting:
    """A collective of ``n`` islands: each joins at its own time; the last one's arrival releases all of
    them at that time."""

    def __init__(self, env: simpy.Environment, n: int) -> None:
        self.count = 0
        self.n = n
        self.all_in = env.event()

    def join(self, now: float) -> simpy.Event:
        self.count += 1
        if self.count == self.n:
            self.all_in.succeed(now)
        return self.all_in


class _Header:
    """Round ``r``'s header meeting. It waits for the islands of the previous round (``expected``);
    with ``wait`` (max_staleness) it also goes on once more than half of the islands alive (expected
    or asking to join) and ``min_islands`` have arrived and the first of them has waited its
    ``wait``. Islands asking to join are taken in when it goes on; an expected island arriving after
    that is late (:meth:`arrive` answers ``None``)."""

    def __init__(self, model: _Model, r: int, expected: set[int], wait: Callable[[int], float] | None) -> None:
        self.model = model
        self.round = r
        self.expected = expected
        self.wait = wait
        self.arrivals: dict[int, float] = {}
        self.present: tuple[int, ...] | None = None
        self.done = model.env.event()
        self._armed = False

    def arrive(self, island: int, now: float) -> simpy.Event | None:
        if self.present is not None:
            return None
        self.arrivals[island] = now
        count, alive = len(self.arrivals), len(self.expected | set(self.model.asking))
        if self.expected <= set(self.arrivals):
            self._go_on()
        elif (self.wait is not None and not self._armed and 2 * count > alive
              and count >= self.model.inputs.min_islands):
            self._armed = True
            first = min(self.arrivals, key=self.arrivals.__getitem__)
            self.model.env.process(self._go_on_at(max(now, self.arrivals[first] + self.wait(first))))
        return self.done

    def _go_on_at(self, at: float) -> Generator[Any, Any, None]:
        yield self.model.env.timeout(at - self.model.env.now)
        if self.present is None:
            self._go_on()

    def _go_on(self) -> None:
        joiners = self.model.asking
        self.model.asking = {}
        self.present = tuple(sorted(set(self.arrivals) | set(joiners)))
        self.done.succeed((self.model.env.now, self))
        for event in joiners.values():
            event.succeed(self)


class _Model:
    """The islands' processes and what they record."""

    def __init__(self, inputs: PlanInputs, rounds: int) -> None:
        self.inputs = inputs
        self.env = simpy.Environment()
        self.n = inputs.num_islands
        self.rounds = rounds
        self.steps = round_steps(inputs, rounds)
        self._costs: dict[tuple[int, tuple[int, ...]], FragmentCost] = {}
        self.everyone = tuple(range(self.n))
        self.costs = [self.cost(r, self.everyone) for r in range(rounds)]
        self.headers: dict[int, _Header] = {}
        self.sizes: dict[int, _Meeting] = {}
        self.asking: dict[int, simpy.Event] = {}  # late islands asking to join the next round, and their answer
        self.segments: list[list[tuple[float, float]]] = [[] for _ in range(self.n)]
        self.finished: list[dict[int, float]] = [{} for _ in range(self.n)]  # island -> round -> its end
        self.exchange_s: list[list[float]] = [[0.0] * rounds for _ in range(self.n)]
        self.catch_up_s = (2 * FP32_BYTES * inputs.numel * 8 / inputs.link.rate_bps(inputs.streams)
                           if inputs.max_staleness else 0.0)

    def cost(self, r: int, present: tuple[int, ...]) -> FragmentCost:
        """Round ``r``'s costs among the islands ``present`` (indexed as in ``present``)."""
        key = (self.inputs.fragment_numel(r), present)
        if key not in self._costs:
            inputs = self.inputs if present == self.everyone else replace(
                self.inputs, islands=tuple(self.inputs.islands[i] for i in present))
            self._costs[key] = fragment_cost(inputs, key[0])
        return self._costs[key]

    def wait(self, r: int, island: int) -> float:
        """How long island ``island``, arrived at round ``r``'s header, waits for the islands not arrived."""
        if self.inputs.staleness_wait_s is not None:
            return self.inputs.staleness_wait_s
        if self.inputs.grace_s is not None:
            return self.inputs.grace_s
        return max(GRACE_FLOOR_S, self.steps[r][island] * self.inputs.islands[island].step_seconds)

    def header(self, r: int) -> _Header:
        if r not in self.headers:
            expected = set(self.headers[r - 1].present or ()) if r else set(self.everyone)
            stale = self.inputs.max_staleness > 0
            self.headers[r] = _Header(self, r, expected, (lambda i: self.wait(r, i)) if stale else None)
        return self.headers[r]

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
        r = 0
        while r < self.rounds:
            steps = self.steps[r][i]
            if pending is None:
                yield from self.compute(i, steps)
            else:
                first = min(tau, steps)
                yield from self.compute(i, first)
                process, cost = pending
                yield process
                yield env.timeout(cost.finish[i])
                self.finished[i][r - 1] = env.now
                pending = None
                yield from self.compute(i, steps - first)
            cost = self.costs[r]
            yield env.timeout(cost.prep[i])  # pseudo-gradient (and, overlapped, the gather)
            process = env.process(self.exchange(i, r))
            if tau == 0:
                r, finish = yield process  # a late island takes part in a later round
                yield env.timeout(finish)
                self.finished[i][r] = env.now
            else:
                pending = (process, cost)
            r += 1
        if pending is not None:
            process, cost = pending
            yield process
            yield env.timeout(cost.finish[i])
            self.finished[i][r - 1] = env.now

    def exchange(self, i: int, r: int) -> Generator[Any, Any, tuple[int, float]]:
        """Island ``i``'s exchange of round ``r`` (or, late, of the round that takes it in): that round
        and the seconds of its own work after it."""
        env, link = self.env, self.inputs.link
        start = env.now
        present = self.everyone
        if self.n > 1:  # the round header through the store (a lone island has no link)
            rs = link.store_rtt
            went_on = self.header(r).arrive(i, env.now)
            if went_on is None:  # late: the round went on without it; it asks to join the next one
                yield env.timeout(3 * rs)
                self.asking[i] = env.event()
                header = yield self.asking[i]
                r, present, last = header.round, header.present, env.now
            else:
                last, header = yield went_on
                present = header.present
            yield self.until(max(start + 3 * rs, last + rs + (rs + link.poll_s) / 2))
            if any(j not in self.headers[r].expected for j in present):
                yield env.timeout(self.catch_up_s)  # a late island joins: the state goes to it
        cost = self.cost(r, present)
        k = present.index(i)
        first, final = cost.chunks[0], cost.chunks[-1]
        yield env.timeout(first.pre[k])
        if r not in self.sizes:
            self.sizes[r] = _Meeting(env, len(present))
        last = yield self.sizes[r].join(env.now)
        yield self.until(last + cost.sizes_s + cost.train_seconds() + final.post[k])
        self.exchange_s[i][r] = env.now - start
        return r, cost.finish[k]


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
    least = STEADY_STALE_ROUNDS if inputs.max_staleness else STEADY_MIN_ROUNDS
    measured = f * math.ceil(least / f)
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
    present = {r: model.headers[r].present or () if r in model.headers else model.everyone for r in range(total)}
    costs = [model.cost(r, present[r]) for r in rounds]
    wire_bits = [8.0 * c.wire_bytes for c in costs]

    def finished(i: int, r: int) -> float:  # an island away from a round is done with it when its members are
        own = model.finished[i].get(r)
        return own if own is not None else max(model.finished[j][r] for j in present[r])

    islands, windows = [], []
    for i, spec in enumerate(inputs.islands):
        lo = finished(i, first - 1) if steady else 0.0
        hi = finished(i, first + count - 1)
        window = hi - lo
        windows.append(window)
        compute = _overlap_seconds(model.segments[i], lo, hi)
        mine = [(c, present[r].index(i)) for r, c in zip(rounds, costs) if i in present[r]]
        local = sum(c.blocking[k] for c, k in mine) / count
        round_s = window / count
        away = [i not in present[r] for r in rounds]
        islands.append(IslandResult(
            utilization=compute / window if window > 0 else 1.0,
            steps_per_round=compute / spec.step_seconds / count,
            round_s=round_s,
            compute_s=compute / count,
            local_s=local,
            waiting_s=max(0.0, round_s - compute / count - local),
            exchange_s=sum(model.exchange_s[i][r] for r in rounds) / count,
            leader_s=sum(c.leader_s[k] for c, k in mine) / count,
            late_fraction=sum(away) / count,
            longest_absence=max((len(run) for run in "".join("x" if a else "." for a in away).split(".")), default=0),
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
