"""The state repair of the sliced exchange: every rank sends or takes its own slice of the state.

Through the leader (:func:`~lightning_islands.engine.health.repair`) the majority's first island
gathers the whole global state (anchors and momentum, every fragment) to its rank 0 and swaps it
with the islands that differ, whose rank 0 receives it all: a host holds the model twice over.
With ``exchange=sliced`` the majority's first island sends its anchors (and momentum) slice by
slice, rank to rank (:func:`~lightning_islands.engine.slice_moves.move_slices`, over the round's
``S`` slices: the ranks of the smallest island present). A lost transfer leaves the island out of
step (it is repaired at its next round, as the leader's repair does); any other failure ends it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_islands.engine.header import RoundHeader
from lightning_islands.engine.health import majority, rebase
from lightning_islands.engine.island import Island
from lightning_islands.engine.layout import CanonicalLayout
from lightning_islands.engine.slice_moves import move_slices, slice_count
from lightning_islands.engine.state import OuterState

log = logging.getLogger(__name__)


def needed(headers: Sequence[RoundHeader]) -> bool:
    """Whether a round with ``headers`` repairs some island: one present outside the majority while
    a majority exists (every rank of every island derives the same from the headers; none for a
    round this island was late for, whose headers are empty, or one that ended the run)."""
    good = majority(headers)
    return bool(good) and any(i not in good and not h.absent for i, h in enumerate(headers))


def repair_sliced(side: Island, layout: CanonicalLayout, state: OuterState, device: torch.device,
                  headers: Sequence[RoundHeader], locals_: Sequence[Tensor], link: Any, chunk: int | None,
                  failed: tuple[str, str] | None = None) -> int:
    """:func:`~lightning_islands.engine.health.repair` slice by slice (module docstring), a collective
    of the island: ``layout`` the whole model's, ``link`` this rank's lanes (the island's link on rank
    0, its RankLink on ranks ``1..S-1``, ``None`` beyond), ``chunk`` values per chunk of a slice
    (``None``: each slice at once); ``failed``: this rank's lanes could not be built. Returns how
    many islands were repaired."""
    good = majority(headers)
    bad = [i for i, h in enumerate(headers) if i not in good and not h.absent]
    if not bad or not good:
        return 0
    src = next(i for i in good if headers[i].votes)  # a voter: the repair sends every fragment
    summary = headers[src].state
    assert summary is not None, "an island that votes has a state summary"
    fields = [state.anchors] + ([state.momentum] if summary.momentum is not None else [])  # read on the source
    taken = move_slices(side, layout, fields if side.index == src else None, len(fields), state.anchors, src, bad,
                        slices=slice_count(headers), link=link, chunk=chunk, device=device, failed=failed,
                        what="the repair")
    if taken is None:
        return len(bad)
    if side.is_leader:
        log.warning("islands: island %d's global state differs from island(s) %s's before round %d (%s vs %s); "
                    "taking island %d's, slice by slice", side.index, good, headers[src].round,
                    headers[side.index].state, summary, src)
    rebase(locals_, state.anchors, taken[0], skip=set(state.indices(summary.fragment)))
    state.load_state_dict({"anchor": taken[0], "momentum": taken[1] if len(taken) > 1 else None,
                           "residual": state.residual,
                           "outer_steps": summary.outer_steps})
    state.write_to(locals_, state.indices(summary.fragment))
    return len(bad)

