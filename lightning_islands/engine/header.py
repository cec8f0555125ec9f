"""A round's header: what every island tells the others before a round's bytes move.

:class:`RoundHeader` is one island's header of one round; an island not present in the round has
one too (:meth:`RoundHeader.absent`), so every list of headers is in island order with no holes.
:class:`StateSummary` is the checksum of the island's global state that the round checks first
(:mod:`lightning_islands.engine.health`). Both travel as JSON through the coordinator; this module
is the one place that encodes and decodes them (:meth:`RoundHeader.to_wire`,
:meth:`RoundHeader.from_wire`), and the wire form carries a version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WIRE_VERSION = 1  # the round header's wire form; an island refuses any other (run one version everywhere)


class HeaderError(ValueError):
    """A round header that this island cannot read (another wire version, or a field missing)."""


@dataclass(frozen=True)
class StateSummary:
    """What every island's global state of one fragment must agree on before a round: the island
    checksums of its anchors and outer momentum (``None``: no momentum) and the outer step counts
    (one, or one per fragment)."""

    fragment: int
    anchors: int
    momentum: int | None
    outer_steps: int | tuple[int, ...]

    @property
    def fragment_steps(self) -> int:
        """The outer step count of the summary's fragment."""
        steps = self.outer_steps
        return steps if isinstance(steps, int) else steps[self.fragment]

    @property
    def agreement(self) -> tuple[int, int, int | None, int]:
        """What islands that agree on the fragment hold alike: its anchors, momentum and outer step
        count (another fragment's count may differ: an island late for that fragment's round)."""
        return self.fragment, self.anchors, self.momentum, self.fragment_steps

    def to_wire(self) -> dict[str, Any]:
        steps = self.outer_steps
        return {"fragment": self.fragment, "anchors": self.anchors, "momentum": self.momentum,
                "outer_steps": steps if isinstance(steps, int) else list(steps)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> StateSummary:
        steps = d["outer_steps"]
        return cls(int(d["fragment"]), int(d["anchors"]), None if d["momentum"] is None else int(d["momentum"]),
                   int(steps) if isinstance(steps, int) else tuple(int(s) for s in steps))


@dataclass(frozen=True)
class RoundHeader:
    """One island's header of one round.

    ``round``: the round's index; ``attempt``: this island's attempt at it (0 first; the
    coordinator, which decides each attempt's members, may number its attempts higher);
    ``fragment``: the fragment the round syncs; ``tokens``: the island's merge weight (its tokens
    since the fragment last synced); ``steps``: its inner steps in the round; ``step_seconds``: its
    seconds per inner step (time balancing); ``experts``: its tokens per expert of each expert
    parameter of the fragment (``None`` without expert weighting); ``stop``: it ends training with
    this round; ``norm``: its pseudo-gradient's norm (``None`` when not finite); ``state``: its
    global state's summary (``None`` for a lone island); ``joining``: it is (re)joining, so its
    state is whatever it restarted with (repaired, not merged, unless it is a recent global state:
    ``max_staleness``); ``absent``: it is not in the round; ``recent``: with ``max_staleness``, the
    checksums of the fragment's global state this island held at its last outer step counts
    (steps -> checksum), by which the others tell a late island's state from a drifted one;
    ``sketch``: with the butterfly, a count sketch of its global state of the fragment (how far apart
    the islands' models are: :meth:`~lightning_islands.engine.layout.CanonicalLayout.sketch`);
    ``run_tokens``: with ``max_tokens``, the run's merged tokens as this island counted them before
    the round (the round counts on from the largest: a late or restarted island's count lags);
    ``ranks``: the island's processes (the sliced exchange cuts the fragment into as many slices as
    the smallest island present has).
    """

    round: int
    attempt: int = 0
    fragment: int = 0
    tokens: float = 0.0
    steps: int = 0
    step_seconds: float = 0.0
    experts: dict[str, list[float]] | None = None
    stop: bool = False
    norm: float | None = None
    state: StateSummary | None = None
    joining: bool = False
    absent: bool = False
    recent: dict[int, int] | None = None
    sketch: tuple[float, ...] | None = None
    run_tokens: int | None = None
    ranks: int = 1

    @classmethod
    def absent_from(cls, round_: int, stop: bool = False) -> RoundHeader:
        """The header of an island that is not present in round ``round_`` (it weighs nothing)."""
        return cls(round_, stop=stop, absent=True)

    @property
    def votes(self) -> bool:
        """Whether the island's global state counts in the round's majority: present and not joining."""
        return not self.absent and not self.joining

    def to_wire(self) -> dict[str, Any]:
        """The header as JSON-able values (what crosses the coordinator)."""
        return {"v": WIRE_VERSION, "round": self.round, "attempt": self.attempt, "fragment": self.fragment,
                "tokens": self.tokens, "steps": self.steps, "step_seconds": self.step_seconds,
                "experts": self.experts, "stop": self.stop, "norm": self.norm,
                "state": None if self.state is None else self.state.to_wire(), "joining": self.joining,
                "absent": self.absent, **({"recent": {str(k): v for k, v in self.recent.items()}} if self.recent
                                          else {}), **({"sketch": list(self.sketch)} if self.sketch else {}),
                **({"run_tokens": self.run_tokens} if self.run_tokens is not None else {}),
                **({"ranks": self.ranks} if self.ranks != 1 else {})}

    @classmethod
    def from_wire(cls, d: dict[str, Any] | None, round_: int, island: int) -> RoundHeader:
        """Island ``island``'s header of round ``round_`` from its wire form (``None``: the island is
        not present). Another wire version, or a header missing a field, is refused naming the island."""
        if d is None:
            return cls.absent_from(round_)
        if d.get("v") != WIRE_VERSION:
            raise HeaderError(f"island {island} sent a round {round_} header of wire version {d.get('v')!r}; this "
                              f"island reads version {WIRE_VERSION}: run the same lightning_islands version on "
                              "every island")
        try:
            experts = d["experts"]
            return cls(int(d["round"]), int(d["attempt"]), int(d["fragment"]), float(d["tokens"]), int(d["steps"]),
                       float(d["step_seconds"]),
                       None if experts is None else {k: [float(c) for c in v] for k, v in experts.items()},
                       bool(d["stop"]), None if d["norm"] is None else float(d["norm"]),
                       None if d["state"] is None else StateSummary.from_wire(d["state"]), bool(d["joining"]),
                       bool(d["absent"]), {int(k): int(v) for k, v in d["recent"].items()} if d.get("recent") else None,
                       tuple(float(v) for v in d["sketch"]) if d.get("sketch") else None,
                       None if d.get("run_tokens") is None else int(d["run_tokens"]), int(d.get("ranks", 1)))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise HeaderError(f"island {island}'s round {round_} header is malformed ({type(err).__name__}: {err}); "
                              "run the same lightning_islands version on every island") from err
