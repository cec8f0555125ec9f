"""Whether every island holds the same global state, and the repair of one that does not.

Each round header carries a checksum of the island's global state of the round's fragment
(:func:`state_summary`). From the headers every island finds the majority (:func:`majority`); an
island outside it takes the anchors and momentum of the first island of the majority over the link
(:func:`repair`) and is left out of that round's merge.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_islands.engine.round import IslandEngine

log = logging.getLogger(__name__)


def majority(headers: Sequence[dict[str, Any]]) -> list[int]:
    """The islands in the largest group of equal global state (the headers' ``state``; a tie: the
    group of the lowest island). Only islands present in the round vote, and an island that is
    (re)joining never does: its state is whatever it restarted with."""
    groups: dict[str, list[int]] = {}
    for i, h in enumerate(headers):
        if not h.get("absent") and not h.get("joining"):
            groups.setdefault(json.dumps(h.get("state"), sort_keys=True), []).append(i)
    return max(groups.values(), key=lambda g: (len(g), -g[0])) if groups else []


def state_summary(engine: IslandEngine, fragment: int) -> dict[str, Any]:
    """What every island's global state of ``fragment`` (the one a round is about to step) must
    agree on before the round, with every fragment's outer step count (a collective of the
    island, cheap: a checksum of each rank's shards at their canonical places, no gather). Each
    fragment is checked once per H steps, in its own round."""
    idx, layout, momentum = engine.state.indices(fragment), engine.fragment_layouts[fragment], engine.state.momentum
    return {"fragment": fragment, "anchors": layout.island_checksum([engine.state.anchors[i] for i in idx]),
            "momentum": None if momentum is None else layout.island_checksum([momentum[i] for i in idx]),
            "outer_steps": engine.state.steps()}


def repair(engine: IslandEngine, headers: Sequence[dict[str, Any]], locals_: Sequence[Tensor]) -> int:
    """Every rank, once the round's headers are known: if some island's global state differs from
    the majority's (the largest group of equal state summaries; a tie goes to the group with the
    lowest island), the first island of the majority sends its anchors and momentum to all and the
    others take them (into ``locals_`` too). Such an island is left out of this round's merge
    (its pseudo-gradient was taken from the wrong anchors). Returns how many islands were repaired."""
    states = [h.get("state") for h in headers]
    good = majority(headers)
    bad = [i for i, h in enumerate(headers) if i not in good and not h.get("absent")]
    if not bad or not good:
        return 0
    src, has_momentum = good[0], states[good[0]]["momentum"] is not None
    n = engine.layout.numel
    if engine.island == src:
        flat = engine.layout.gather_to_leader(engine.state.anchors, engine.device)
        if has_momentum:
            flat_m = engine.layout.gather_to_leader(engine.state.momentum, engine.device)  # type: ignore[arg-type]
            flat = None if flat is None else torch.cat([flat, flat_m])  # type: ignore[list-item]
        engine.agree(lambda: engine.link.broadcast_bytes(flat.cpu().view(torch.uint8), src=src))  # type: ignore
        return len(bad)
    box: dict[str, Tensor] = {}
    engine.agree(lambda: box.update(flat=engine.link.broadcast_bytes(None, src=src)))  # type: ignore[union-attr]
    if engine.island not in bad:
        return len(bad)
    if engine.is_leader:
        log.warning("islands: island %d's global state differs from island(s) %s's before round %d (%s vs %s); "
                    "taking island %d's", engine.island, good, engine.schedule.round, states[engine.island],
                    states[src], src)
    flat = box["flat"].view(torch.float32) if engine.is_leader else None
    anchors = engine.layout.scatter_from_leader(None if flat is None else flat[:n], engine.device)
    momentum = (engine.layout.scatter_from_leader(None if flat is None else flat[n:], engine.device)
                if has_momentum else None)
    engine.state.load_state_dict({"anchor": anchors, "momentum": momentum, "residual": engine.state.residual,
                                  "outer_steps": states[src]["outer_steps"]})
    engine.state.write_to(locals_)
    return len(bad)
