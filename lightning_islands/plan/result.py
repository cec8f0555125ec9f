"""What a plan predicts: utilization per island, where a round's time goes, and the link's load."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class IslandResult:
    """One island over the measured rounds (per-round figures are means).

    ``utilization`` = compute time / wall time; ``compute_s`` the inner steps of a round, ``local_s`` the
    island's own blocking work in it (pseudo-gradient, gather, codec when synchronous, scatter, outer
    step), ``waiting_s`` the rest (the slowest island, the link, a background exchange that outlasted
    the overlap); ``exchange_s`` from the round's header to the last chunk merged; ``leader_s`` the
    leader's path (gather, codec, merge, scatter), wherever it ran; ``late_fraction`` the share of the
    rounds the others went on without it (``max_staleness``) and ``longest_absence`` the most of them
    in a row (its work is dropped when that exceeds ``max_staleness``)."""

    utilization: float
    steps_per_round: float
    round_s: float
    compute_s: float
    local_s: float
    waiting_s: float
    exchange_s: float
    leader_s: float
    late_fraction: float = 0.0
    longest_absence: int = 0


@dataclass(frozen=True)
class PlanResult:
    """The prediction of :func:`~lightning_islands.plan.simulate.simulate`.

    ``bytes_per_round``: bytes each island sends in a round (its padded payloads to the N - 1 others,
    or to its butterfly partners);
    ``mean_bps``: what an island sends over the measured wall time; ``peak_bps``: the bandwidth the
    schedule asks for at its busiest, a round's bits over the time it may take without stalling
    (``overlap_steps`` inner steps, or one inner step for a synchronous round), the largest over rounds
    and islands; ``link_rate_bps``: the rate an island's egress runs at while it sends (the link, or the
    lanes' TCP windows over the round trip if smaller); ``link_busy_fraction``: the share of the wall
    time it sends; ``link_s``: a round's payload transfers, latency included; ``latency_s``: the round
    trips a round waits through (the header's, and each chunk's size and payload all-gathers);
    ``leader_bytes``: fp32
    bytes the leader gathers at once (a chunk, or the whole fragment when the round overlaps).
    ``rounds``: rounds measured; ``steady``: measured after a warm-up (else the whole run)."""

    islands: tuple[IslandResult, ...]
    devices: tuple[int, ...]
    bytes_per_round: float
    mean_bps: float
    peak_bps: float
    link_rate_bps: float
    link_busy_fraction: float
    link_s: float
    latency_s: float
    leader_bytes: int
    rounds: int
    steady: bool

    @property
    def utilization(self) -> list[float]:
        """Per island: compute time / wall time."""
        return [i.utilization for i in self.islands]

    @property
    def idle_fraction(self) -> list[float]:
        """Per island: 1 - utilization."""
        return [1.0 - i.utilization for i in self.islands]

    @property
    def min_utilization(self) -> float:
        """The least-used island's utilization (what a target must hold for)."""
        return min(self.utilization)

    @property
    def utilization_overall(self) -> float:
        """Utilization of all devices together (islands weighted by their devices)."""
        return sum(u * d for u, d in zip(self.utilization, self.devices)) / sum(self.devices)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields, the per-island lists, and ``inf`` as ``None``."""
        out: dict[str, Any] = {
            "utilization": self.utilization,
            "idle_fraction": self.idle_fraction,
            "utilization_overall": self.utilization_overall,
            "min_utilization": self.min_utilization,
        }
        for key, value in asdict(self).items():
            if key != "islands":
                out[key] = value
        out["devices"] = list(self.devices)
        out["islands"] = [asdict(i) for i in self.islands]
        return _finite(out)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
