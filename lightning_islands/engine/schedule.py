"""When rounds happen: H per round (with its warm-up), time balancing, ``max_rounds``, and the clock.

Plain counters and arithmetic: the strategy reports each closed inner step (:meth:`Schedule.close_step`),
and the schedule says when a round is due and how many steps the next one runs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from lightning_islands.engine.header import RoundHeader
from lightning_islands.engine.settings import IslandSettings


class Schedule:
    """This island's position in the rounds, and the rule for the next round's length.

    A round syncs one fragment (:attr:`fragment`); with F fragments it runs H / F inner steps.
    ``balance="none"``: every round runs its H / F (``sync_warmup`` first, then ``sync_every``), or
    this island's fixed ``steps_per_round`` scaled by ``H_round / (sync_every F)``. ``"time"``:
    after each round the budget is H / F steps of the slowest island, and each island runs the steps
    that fit it (at most 8 H / F).
    """

    def __init__(self, settings: IslandSettings, island: int) -> None:
        self.settings = settings
        self.island = island
        self.round = 0
        self.round_steps = 0
        self.inner_steps = 0
        self.total_tokens = 0
        self.run_tokens = 0  # tokens merged into the global model, summed over the islands (max_tokens)
        self.stopping = False  # the islands agreed to stop: no further rounds start
        self.steps_per_round = self.planned_steps(0)
        # the round's clock (step time for balance="time"): validation and a fit's first step excluded
        self._round_started = time.perf_counter()
        self._untimed_seconds = 0.0
        self._timed_steps = 0
        self._untimed_first_step = False

    # ------------------------------------------------------------------ round lengths
    def round_sync_every(self, round_index: int) -> int:
        """H of round ``round_index`` (counting from 0): ``sync_warmup`` first, then ``sync_every``."""
        warmup = self.settings.sync_warmup or []
        return warmup[round_index] if round_index < len(warmup) else self.settings.sync_every

    @property
    def fragment(self) -> int:
        """The fragment the current round syncs: fragments take turns, round by round."""
        return self.round % self.settings.fragments

    def planned_steps(self, round_index: int) -> int:
        """This island's inner steps in round ``round_index`` without time balancing: H / F (a
        fragment syncs every H steps), or the fixed ``steps_per_round`` scaled alike."""
        h, f = self.round_sync_every(round_index), self.settings.fragments
        fixed = self.settings.steps_per_round
        return h // f if fixed is None else max(1, round(fixed * h / (self.settings.sync_every * f)))

    def next_round_steps(self, headers: Sequence[RoundHeader]) -> int:
        """The next round's inner steps for this island, from every island's round header."""
        if self.settings.balance != "time":
            return self.planned_steps(self.round + 1)
        h = self.round_sync_every(self.round + 1) // self.settings.fragments
        timed = [hdr for hdr in headers if hdr.votes]
        mine = headers[self.island]
        if not timed or not mine.votes:  # a joiner's clock measured its wait, not steps
            return self.planned_steps(self.round + 1)
        budget = h * max(max(float(hdr.step_seconds), 1e-9) for hdr in timed)
        return max(1, min(8 * h, round(budget / max(float(mine.step_seconds), 1e-9))))

    def in_last_round(self) -> bool:
        """Whether the current round is round ``max_rounds``, the last one allowed."""
        return self.settings.max_rounds is not None and self.round + 1 >= self.settings.max_rounds

    def next_step_ends_last_round(self) -> bool:
        """Whether the step being taken completes round ``max_rounds`` (every island knows it alike)."""
        return not self.stopping and self.in_last_round() and self.round_steps + 1 >= self.steps_per_round

    # ------------------------------------------------------------------ progress
    def close_step(self) -> bool:
        """Count one finished inner step; returns whether the round is due now."""
        self.inner_steps += 1
        self.round_steps += 1
        self._timed_steps += 1
        if self._untimed_first_step:
            # The first step of a fit also pays for starting the data loader (and any warm-up):
            # time this round from its end, unless it is the round's only step.
            self._untimed_first_step = False
            if self.round_steps < self.steps_per_round:
                self.restart_clock()
        return self.round_steps >= self.steps_per_round and not self.stopping

    def advance(self, tokens: float, headers: Sequence[RoundHeader], steps_since: int = 0, merged: float = 0.0) -> None:
        """The round ended with an outer step: count it and plan the next one. ``steps_since``: inner
        steps taken since the round's sync point (an overlapped round); they count for the next.
        ``merged``: the tokens the round merged, summed over the islands (the run's count, ``max_tokens``)."""
        next_steps = self.within_budget(self.next_round_steps(headers), merged)
        self.round += 1
        self.round_steps = steps_since
        self.total_tokens += int(tokens)
        self.run_tokens += int(merged)
        self.steps_per_round = next_steps

    def within_budget(self, steps: int, merged: float) -> int:
        """``steps``, or fewer when the next round would overshoot ``max_tokens``: the round that just
        merged ``merged`` tokens over this island's ``round_steps`` predicts the next round's tokens
        per step; the next round then runs the steps that reach what the budget has left, rounded up
        (every island scales its own steps by the same factor, so time-balanced islands keep their
        ratio). A round with fewer islands than predicted leaves a remainder for one more round."""
        budget = self.settings.max_tokens
        if budget is None or merged <= 0 or self.round_steps < 1:
            return steps
        left, per_step = budget - self.run_tokens - int(merged), merged / self.round_steps
        if left <= 0:
            return steps
        return steps if per_step * steps <= left else max(1, math.ceil(left / per_step))

    def spends_budget(self, merged: float) -> bool:
        """Whether a round that merges ``merged`` tokens (every island's, as every island counts them
        from the headers) reaches the run's ``max_tokens``: the islands stop after it."""
        budget = self.settings.max_tokens
        return budget is not None and self.run_tokens + int(merged) >= budget

    def skip(self, steps_since: int = 0) -> None:
        """The round went on without this island: move to the next one without an outer step."""
        self.round += 1
        self.round_steps = steps_since
        self.steps_per_round = self.planned_steps(self.round)
        self.restart_clock()

    def rejoin(self, round_: int) -> None:
        """A restarted island enters the rounds at ``round_`` (the live islands' current round)."""
        self.round, self.round_steps, self.stopping = round_, 0, False
        self.steps_per_round = self.planned_steps(round_)
        self.restart_clock()

    # ------------------------------------------------------------------ the clock
    def restart_clock(self, untimed_first_step: bool = False) -> None:
        """Time the round from now: no steps, nothing untimed yet. ``untimed_first_step``: the next
        step starts a fit and is not timed."""
        self._round_started = time.perf_counter()
        self._untimed_seconds = 0.0
        self._timed_steps = 0
        self._untimed_first_step = untimed_first_step or self._untimed_first_step

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (a validation run) out of the round's step time."""
        self._untimed_seconds += seconds

    def step_seconds(self, now: float) -> float:
        """Mean seconds per timed step of this round, up to ``now`` (``time.perf_counter()``)."""
        return (now - self._round_started - self._untimed_seconds) / max(1, self._timed_steps)

    def seconds_to_round(self, now: float) -> float | None:
        """The seconds this island's steps left in the round take at this round's pace so far (its
        expected arrival at the round's meeting); ``None`` before a timed step."""
        if self._timed_steps < 1 or self.stopping:
            return None
        return max(0, self.steps_per_round - self.round_steps) * self.step_seconds(now)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The counters a checkpoint keeps (the keys of the checkpoint's ``islands`` entry)."""
        return {"round": self.round, "inner_steps": self.inner_steps, "round_steps": self.round_steps,
                "total_tokens": self.total_tokens, "steps_per_round": self.steps_per_round,
                "stopping": self.stopping, "run_tokens": self.run_tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (older checkpoints may lack the last three keys)."""
        self.round, self.inner_steps, self.round_steps = state["round"], state["inner_steps"], state["round_steps"]
        self.total_tokens = state["total_tokens"]
        self.run_tokens = int(state.get("run_tokens", 0))
        self.stopping = bool(state.get("stopping", False))
        self.steps_per_round = int(state.get("steps_per_round", self.steps_per_round))
