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
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any

import simpy

from lightning_islands.plan.costs import FragmentCost, fragment_cost
from lightning_islands.plan.inputs import PlanInputs
from lightning_islands.plan.result import IslandResult, PlanResult
from lightning_islands.plan.schedule import round_steps

STEADY_MIN_ROUNDS = 8  # rounds measured in the steady state, at least (a whole number of fragment cycles)


class _Meeting:
    """A collective of all islands: each joins at its own time; the last one's arrival releases all of
    them with every island's arrival time."""

    def __init__(self, env: simpy.Environment, n: int) -> None:
        self.arrivals: list[float] = []
        self.n = n
        self.all_in = env.event()

    def join(self, now: float) -> simpy.Event:
        self.arrivals.append(now)
        if len(self.arrivals) == self.n:
            self.all_in.succeed(max(self.arrivals))
        return self.all_in


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

    def meeting(self, kind: str, r: int) -> _Meeting:
        key = (kind, r)
        if key not in self.meetings:
            self.meetings[key] = _Meeting(self.env, self.n)
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
            steps = self.steps[r][i]
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
            last = yield self.meeting("header", r).join(env.now)
            yield self.until(max(start + 3 * rs, last + rs + (rs + link.poll_s) / 2))
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
