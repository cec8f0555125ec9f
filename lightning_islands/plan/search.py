"""The smallest link bandwidth that keeps every island's utilization at or above a target.

Utilization never falls when the link gets faster (every event of the model happens no later), so a
bisection on a log scale finds the threshold. It first checks an unlimited link: when even that
misses the target, no bandwidth is enough and the answer says what limits the plan instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lightning_islands.plan.inputs import PlanInputs, with_link
from lightning_islands.plan.result import PlanResult
from lightning_islands.plan.simulate import simulate

LOWEST_BPS = 1e3  # 1 kbit/s: below this the answer is "any link"
HIGHEST_BPS = 1e16  # 10 Pbit/s: the bisection's upper end once an unlimited link reaches the target


@dataclass(frozen=True)
class LinkNeed:
    """The answer of :func:`min_link_bps`: ``bps`` (``None`` when no link reaches the target) and a
    sentence saying what decided it."""

    bps: float | None
    target: float
    note: str


def _why_not(inputs: PlanInputs, best: PlanResult, target: float) -> str:
    """Why even an unlimited link misses ``target`` (``best``: the plan over one)."""
    island = min(range(inputs.num_islands), key=lambda i: best.utilization[i])
    row = best.islands[island]
    link = replace(inputs.link, bps=math.inf, tcp_window_bytes=math.inf)
    if simulate(replace(inputs, link=link)).min_utilization >= target:
        cap = replace(inputs.link, bps=math.inf).rate_bps(inputs.streams)
        return (f"the lanes' TCP windows cap the link at {cap / 1e9:.3g} Gbit/s ({inputs.streams} streams x "
                f"{inputs.link.window / 2**20:.3g} MiB / {inputs.link.rtt_s * 1e3:.3g} ms): add lanes "
                "(islands.lanes) or raise the hosts' TCP buffers (net.ipv4.tcp_rmem, tcp_wmem)")
    why = (f"even an unlimited link leaves island {island} at {best.min_utilization:.3f}: per round it computes "
           f"{row.compute_s:.3g} s, works {row.local_s:.3g} s on its own (gather, codec, scatter, outer step) and "
           f"waits {row.waiting_s:.3g} s")
    if best.latency_s > 0.2 * row.waiting_s > 0:
        why += (f"; a round waits through {best.latency_s:.3g} s of round trips: raise H, overlap "
                "(islands.overlap_steps) or use larger exchange chunks (islands.exchange_chunk_mib)")
    if inputs.balance == "none" and len({s.step_seconds for s in inputs.islands}) > 1:
        why += "; the faster islands wait for the slowest: islands.balance=time"
    return why


def _meets(inputs: PlanInputs, bps: float, target: float) -> bool:
    return simulate(with_link(inputs, bps)).min_utilization >= target


def min_link_bps(inputs: PlanInputs, target: float = 0.97, rel_tol: float = 1e-3) -> LinkNeed:
    """The smallest link (bits per second per island egress) at which every island's utilization is at
    least ``target``, to a relative precision of ``rel_tol``."""
    if not 0 < target <= 1:
        raise ValueError(f"the utilization target must be in (0, 1], got {target}: e.g. 0.97")
    if inputs.num_islands == 1:
        return LinkNeed(0.0, target, "one island: no link is used")
    best = simulate(with_link(inputs, math.inf))
    if best.min_utilization < target:
        return LinkNeed(None, target, _why_not(inputs, best, target))
    lo, hi = LOWEST_BPS, HIGHEST_BPS
    if _meets(inputs, lo, target):
        return LinkNeed(lo, target, f"any link of {lo:g} bit/s or more reaches the target")
    if not _meets(inputs, hi, target):
        return LinkNeed(None, target, f"not reached below {hi:g} bit/s")
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if _meets(inputs, mid, target):
            hi = mid
        else:
            lo = mid
    return LinkNeed(hi, target, "bisection")
