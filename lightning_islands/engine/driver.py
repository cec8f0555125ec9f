"""When a round lands and starts, for any training loop: the sequencing around :class:`IslandEngine`.

The loop trains and reports each closed inner step (:meth:`RoundDriver.step_closed`); the driver
lands the round in flight once it has flown ``overlap_steps`` steps, and runs the round the schedule
asks for: in the background while the next inner steps run, or synchronously when it is the last
one or nothing overlaps. At the end of training (:meth:`RoundDriver.end`) this island's last round
tells the others to stop, unless they already agreed to.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from lightning_islands.engine.round import IslandEngine

Experts = dict[str, list[float]]


class RoundDriver:
    """Lands and starts an island's rounds for a training loop (every rank of the island runs one).

    Args:
        engine: this rank's engine, after the islands have met and adopted the initial state.
        locals_: returns this rank's local shards (what :meth:`IslandEngine.start` takes); called
            only when a round starts or lands (it may be costly: FSDP reshards for it).
        experts: returns the island's tokens per expert of the round (an island collective), or
            None; called only when a round starts. Default: no expert counts.
        on_round: called with each landed or finished round's metrics (empty when no island stepped)
            and whether the islands agreed to stop after it: logging and callbacks. Its time, like
            the landing's, is left out of the round's step time.
        last: whether the round about to start is this island's last (it then runs synchronously
            and tells the others to stop). Default: the schedule's ``max_rounds``.
    """

    def __init__(self, engine: IslandEngine, locals_: Callable[[], Sequence[Tensor]],
                 experts: Callable[[], Experts | None] | None = None,
                 on_round: Callable[[dict[str, float], bool], Any] | None = None,
                 last: Callable[[], bool] | None = None) -> None:
        self.engine = engine
        self._locals = locals_
        self._experts = experts or (lambda: None)
        self._on_round = on_round or (lambda metrics, stop: None)
        self._last = last or (lambda: self.engine.schedule.in_last_round())

    def step_closed(self) -> None:
        """An inner step ended: count it, land the round in flight if it has flown its
        ``overlap_steps``, and run the round if one is due."""
        due = self.engine.schedule.close_step()
        if self.engine.landing_due():
            self.land()
        if due:
            self.run_round()

    def land(self) -> None:
        """Land the round in flight, if any (every rank): its outer step, blended into the local
        shards. Waiting for it (and ``on_round``) is not step time."""
        engine = self.engine
        if engine.in_flight is None:
            return
        started = time.perf_counter()
        self._on_round(*engine.land(self._locals()))
        engine.schedule.exclude(time.perf_counter() - started)

    def run_round(self, final: bool = False) -> dict[str, float]:
        """Run a round now (every rank of every island), after landing the one in flight: in the
        background when ``overlap_steps`` is set and it is not the last round (returns no metrics
        then: they come when it lands), else synchronously (returns its metrics).

        ``final``: this island is ending training (its last, possibly partial or empty, round); the
        others learn it through the round header and stop after this round too.
        """
        engine = self.engine
        self.land()  # the round in flight lands before the next one starts
        started = time.perf_counter()  # the round's clock includes gathering its inputs, as the step time excludes it
        last = final or self._last()
        if engine.settings.overlap_steps and not last:  # it flies while the next inner steps run; the last never does
            engine.start(self._locals(), self._experts(), False, started, background=True)
            return {}
        metrics, stop = engine.run_round(self._locals(), self._experts(), last, started)
        self._on_round(metrics, stop)
        if metrics:
            engine.schedule.restart_clock()
        return metrics

    def end(self) -> bool:
        """Training ends here (every rank): land the round in flight, then, unless the islands already
        agreed to stop, run this island's last round, which tells the others to stop after it.

        Returns whether they had agreed to stop: the steps taken since the last round are merged
        nowhere, and the caller should end on the global parameters (``engine.state.write_to``).
        """
        self.land()
        if self.engine.schedule.stopping:
            return True
        self.run_round(final=True)
        return False
