"""Who is merged in a round, and with which weights: decided from the round's headers alone.

Every island derives the same :class:`MergePlan` from the same headers: the members (islands that
hold the majority's global state with a sound pseudo-gradient), each island's merge weight (its
tokens, or 1 with ``weighting="equal"``) and, with expert weighting, each member's per-expert
coefficients. The merge itself runs a chunk at a time in :mod:`lightning_islands.engine.exchange`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor

from lightning_islands.engine import health, outer
from lightning_islands.engine.header import RoundHeader
from lightning_islands.engine.layout import CanonicalLayout

log = logging.getLogger(__name__)


def members(headers: Sequence[RoundHeader], exclude_norm_ratio: float | None,
            agreeing: Sequence[int] | None = None) -> list[int]:
    """The islands merged this round: those that hold the majority's global state
    (:func:`health.majority`; or ``agreeing``, with the butterfly: each group's own) with a sound
    pseudo-gradient (:func:`outer.merge_members` of the norms)."""
    agree = set(health.majority(headers) if agreeing is None else agreeing)
    return outer.merge_members([h.norm if i in agree else None for i, h in enumerate(headers)], exclude_norm_ratio)


def stale_islands(headers: Sequence[RoundHeader], agreeing: Sequence[int], max_staleness: int) -> dict[int, int]:
    """The islands outside ``agreeing`` whose global state of the round's fragment is the one the
    first agreeing island held 1 to ``max_staleness`` outer steps ago (its header's ``recent``
    checksums) and that took inner steps since (a restarted island brings none): late, not drifted.
    Each with its age in rounds of the fragment."""
    if not max_staleness or not agreeing:
        return {}
    src = headers[agreeing[0]]
    if src.state is None or not src.recent:
        return {}
    now, found = src.state.fragment_steps, {}
    for i, h in enumerate(headers):
        if i in agreeing or h.absent or h.state is None or h.steps <= 0:  # a restart took no steps since
            continue
        age = now - h.state.fragment_steps
        if 1 <= age <= max_staleness and src.recent.get(h.state.fragment_steps) == h.state.anchors:
            found[i] = age
    return found


@dataclass(frozen=True)
class MergePlan:
    """A round's merge: its ``headers`` (island order), the ``members`` merged, every island's
    ``weights``, and per expert parameter name the members' per-expert ``coefs`` (expert weighting;
    empty without it)."""

    headers: list[RoundHeader]
    members: list[int]
    weights: list[float]
    coefs: dict[str, list[Tensor]]
    agreeing: tuple[int, ...] = ()  # the islands that hold the state they must (the rest are repaired)
    stale: dict[int, int] = field(default_factory=dict)  # max_staleness: late islands merged, and their age

    @property
    def stepped(self) -> bool:
        """Whether some island took inner steps (else the round only agreed to stop)."""
        return any(h.steps > 0 for h in self.headers)

    @property
    def stop(self) -> bool:
        """Whether some island ends training with this round (so every island does)."""
        return any(h.stop for h in self.headers)

    @classmethod
    def of(cls, headers: Sequence[RoundHeader], weighting: str, exclude_norm_ratio: float | None,
           layout: CanonicalLayout, agreeing: Sequence[int] | None = None, max_staleness: int = 0,
           staleness_decay: float = 1.0, ages: dict[int, int] | None = None) -> MergePlan:
        """The plan every island derives from ``headers`` (``agreeing``: as :func:`members`; with
        ``max_staleness``, late islands whose state is a recent global state (:func:`stale_islands`)
        are merged too, their weight times ``staleness_decay`` per round of age); an error naming
        the cause and the fix when no island can be merged. ``ages``: with the butterfly, the late
        islands among ``agreeing`` and their ages (each island's state is its own there): those
        older than ``max_staleness`` are not merged."""
        agreeing = health.majority(headers) if agreeing is None else agreeing
        if ages is None:
            stale = stale_islands(headers, agreeing, max_staleness)
        else:
            # a late island's work, if it has any (a restarted one took no steps since: it adopts)
            fresh = [i for i in agreeing if not ages.get(i) or (ages[i] <= max_staleness and headers[i].steps > 0)]
            stale = {i: ages[i] for i in fresh if ages.get(i)}
            agreeing = fresh
        headers, chosen = list(headers), members(headers, exclude_norm_ratio, [*agreeing, *stale])
        round_ = headers[0].round
        if not chosen and not agreeing:
            raise RuntimeError(f"round {round_}: every island present is rejoining, so none holds the global state; "
                               "restart the run from the islands' last checkpoints (resume=...)")
        if not chosen:
            raise RuntimeError(f"round {round_}: every island's pseudo-gradient is non-finite (NaN or inf): training "
                               "diverged; resume from an earlier checkpoint with a lower learning rate")
        coefs, rows = {}, {e.name: e.shape[0] for e in layout.entries}
        for name in headers[chosen[0]].experts or {}:  # None without expert weighting
            coefs[name] = outer.expert_coefficients([headers[i].experts[name] for i in chosen])  # type: ignore
            if rows[name] != coefs[name][0].numel():
                raise ValueError(f"{name} has {rows[name]} rows but {coefs[name][0].numel()} expert counts")
        weights = [(1.0 if weighting == "equal" else float(h.tokens)) * staleness_decay ** stale.get(i, 0)
                   for i, h in enumerate(headers)]
        return cls(headers, chosen, weights, coefs, tuple(agreeing), {i: a for i, a in stale.items() if i in chosen})

    def staleness_metrics(self, island: int) -> dict[str, float]:
        """With ``max_staleness``: the age of this island's pseudo-gradient in the round (0: current;
        -1: too old, or its state not a recent global one: not merged) and how many late ones the
        round merged."""
        h = self.headers[island]
        age = self.stale.get(island, 0 if island in self.agreeing or h.absent else -1)
        return {"islands/staleness": float(age), "islands/stale_merged": float(len(self.stale))}

    def left_out(self) -> list[int]:
        """Islands present, not joining, holding the state they must, and not merged (a non-finite or
        outlying pseudo-gradient)."""
        return [i for i in self.agreeing if i not in self.members and self.headers[i].votes]

    def warn_left_out(self, exclude_norm_ratio: float | None) -> None:
        """Log the islands left out of the merge and why (the leader does, once a round)."""
        left_out = self.left_out()
        if left_out:
            log.warning("islands: round %d merges without island(s) %s: pseudo-gradient norms %s (non-finite, or more "
                        "than exclude_norm_ratio=%s times the median); they adopt the merged result",
                        self.headers[0].round, left_out, [h.norm for h in self.headers], exclude_norm_ratio)

    def expert_gap_metrics(self) -> dict[str, float]:
        """With expert weighting: how far the per-expert coefficients were from the islands' merge
        weights this round (largest, and token-weighted mean over experts, averaged over the expert
        parameters); nothing without it."""
        names = list(self.headers[self.members[0]].experts or {}) if self.members else []
        if not names:
            return {}
        weights = [self.weights[i] for i in self.members]
        gaps = [outer.expert_share_gap([self.headers[i].experts[n] for i in self.members], weights)  # type: ignore
                for n in names]
        return {"islands/expert_share_gap_max": max(g[0] for g in gaps),
                "islands/expert_share_gap_mean": sum(g[1] for g in gaps) / len(gaps)}
