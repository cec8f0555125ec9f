"""Whether every island holds the same global state, and the repair of one that does not.

Each round header carries a checksum of the island's global state of the round's fragment
(:func:`state_summary`). From the headers every island finds the majority (:func:`majority`); an
island outside it takes the anchors and momentum of the first island of the majority over the link
(:func:`repair`) and is left out of that round's merge.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_islands.engine.header import RoundHeader, StateSummary
from lightning_islands.engine.island import Island
from lightning_islands.engine.layout import CanonicalLayout
from lightning_islands.engine.state import OuterState

log = logging.getLogger(__name__)


def _agreement(state: StateSummary | None) -> tuple | None:
    return None if state is None else state.agreement


def majority(headers: Sequence[RoundHeader]) -> list[int]:
    """The islands that hold the global state of the round's fragment that the largest group holds
    (:attr:`StateSummary.agreement`; a tie: the group of the lowest island). Only islands present in
    the round vote, and an island that is (re)joining never does (its state is whatever it restarted
    with), but one whose state equals the winners' holds it too."""
    groups: dict[tuple | None, list[int]] = {}
    for i, h in enumerate(headers):
        if h.votes:
            groups.setdefault(_agreement(h.state), []).append(i)
    if not groups:
        return []
    won = max(groups.items(), key=lambda kv: (len(kv[1]), -kv[1][0]))[0]
    return [i for i, h in enumerate(headers) if not h.absent and _agreement(h.state) == won]


def state_summary(state: OuterState, layout: CanonicalLayout, fragment: int, stage: int | None = None
                  ) -> StateSummary:
    """What every island's global state of ``fragment`` (the one a round is about to step, laid out
    by ``layout``) must agree on before the round, with every fragment's outer step count (a
    collective of the island, cheap: a checksum of each rank's shards at their canonical places,
    no gather). Each fragment is checked once per H steps, in its own round. With the butterfly
    (``stage``), the islands of a group must agree on the stage's base instead (their global states
    and momenta are their own: :mod:`lightning_islands.engine.mixing`)."""
    idx, momentum, steps = state.indices(fragment), state.momentum, state.steps()
    if stage is not None:
        return StateSummary(fragment, layout.island_checksum([state.bases[stage][i] for i in idx]), None,
                            steps if isinstance(steps, int) else tuple(steps))
    return StateSummary(fragment, layout.island_checksum([state.anchors[i] for i in idx]),
                        None if momentum is None else layout.island_checksum([momentum[i] for i in idx]),
                        steps if isinstance(steps, int) else tuple(steps))


def repair(island: Island, layout: CanonicalLayout, state: OuterState, device: torch.device,
           headers: Sequence[RoundHeader], locals_: Sequence[Tensor]) -> int:
    """Every rank, once the round's headers are known: if some island's global state differs from
    the majority's (the largest group of equal state summaries; a tie goes to the group with the
    lowest island), the first island of the majority sends its anchors and momentum to those islands
    alone (a swap: no island in step pays for the transfer) and they take them (into ``locals_``
    too). Such an island is left out of this round's merge (its pseudo-gradient was taken from the
    wrong anchors). Returns how many islands were repaired."""
    good = majority(headers)
    bad = [i for i, h in enumerate(headers) if i not in good and not h.absent]
    if not bad or not good:
        return 0
    # the source votes: an island that agrees on this fragment without voting (late, or rejoining) may
    # hold other fragments behind, and the repair sends every fragment
    src = next(i for i in good if headers[i].votes)
    summary = headers[src].state
    assert summary is not None, "an island that votes has a state summary"
    has_momentum, n = summary.momentum is not None, layout.numel
    if island.index == src:
        flat = layout.gather_to_leader(state.anchors, device)
        if has_momentum:
            flat_m = layout.gather_to_leader(state.momentum, device)  # type: ignore[arg-type]
            flat = None if flat is None else torch.cat([flat, flat_m])  # type: ignore[list-item]
        island.on_leader(lambda link: link.swap_bytes(flat.cpu().view(torch.uint8), bad, limit=0))  # type: ignore
        return len(bad)
    # only the islands repaired receive it; every island swaps (the others with nobody), so that each
    # island's sequence of payloads stays in step with the others'
    peers, limit = ([src] if island.index in bad else []), 4 * n * (2 if has_momentum else 1)
    got = island.on_leader(lambda link: link.swap_bytes(torch.empty(0, dtype=torch.uint8), peers, limit=limit))
    if island.index not in bad:
        return len(bad)
    received = None if got is None else got[src]
    if island.is_leader:
        log.warning("islands: island %d's global state differs from island(s) %s's before round %d (%s vs %s); "
                    "taking island %d's", island.index, good, headers[src].round, headers[island.index].state,
                    summary, src)
    flat = None if received is None else received.view(torch.float32)
    anchors = layout.scatter_from_leader(None if flat is None else flat[:n], device)
    momentum = layout.scatter_from_leader(None if flat is None else flat[n:], device) if has_momentum else None
    rebase(locals_, state.anchors, anchors, skip=set(state.indices(summary.fragment)))
    state.load_state_dict({"anchor": anchors, "momentum": momentum, "residual": state.residual,
                           "outer_steps": summary.outer_steps})
    state.write_to(locals_, state.indices(summary.fragment))
    return len(bad)


@torch.no_grad()
def rebase(locals_: Sequence[Tensor], old: Sequence[Tensor], new: Sequence[Tensor], skip: set[int]) -> None:
    """Move the local parameters (but those of ``skip``) from the anchors ``old`` to ``new``, keeping
    the island's own progress since its anchors (``local - old``): a repaired island loses none of the
    work it has not synced in the fragments other than the round's (where the round merged it or
    dropped it)."""
    for i, (loc, a, b) in enumerate(zip(locals_, old, new)):
        if i not in skip:
            loc.copy_((loc.to(a.device, torch.float32) - a + b.to(a.device)).to(loc.device, loc.dtype))
