"""The state repair of the sliced exchange: every rank sends or takes its own slice of the state.

Through the leader (:func:`~lightning_islands.engine.health.repair`) the majority's first island
gathers the whole global state (anchors and momentum, every fragment) to its rank 0 and swaps it
with the islands that differ, whose rank 0 receives it all: a host holds the model twice over.
With ``exchange=sliced`` the state is cut into the round's ``S`` slices (the ranks of the smallest
island present, :func:`~lightning_islands.engine.sliced.slice_count`) and moved a chunk at a time:
the source island moves chunk ``k`` of each slice of its anchors (and momentum) to the slice's
owner (:meth:`CanonicalLayout.to_owners`), each owner swaps it over its own lanes with the same
rank of the islands repaired, and there the owner sends it back to the shards
(:meth:`CanonicalLayout.from_owners`). Every owner of every island swaps once per chunk (with
nobody when its island is neither the source nor repaired), so that the lanes' sequences of payloads
stay in step. After the last chunk the island learns every slice's outcome at once: a lost transfer
is :class:`~lightning_islands.link.protocol.RoundLost` on every rank (the island stays out of step
and is repaired at its next round, as the leader's repair does), any other failure ends the island.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

import torch
from torch import Tensor

from lightning_islands.engine import outer
from lightning_islands.engine.header import RoundHeader
from lightning_islands.engine.health import majority, rebase
from lightning_islands.engine.island import Island
from lightning_islands.engine.layout import CanonicalLayout
from lightning_islands.engine.sliced import slice_bounds, slice_count
from lightning_islands.engine.state import OuterState
from lightning_islands.link.protocol import RoundLost

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
    me, rank = side.index, layout.group.rank
    summary = headers[src].state
    assert summary is not None, "an island that votes has a state summary"
    fields = 2 if summary.momentum is not None else 1  # the source's anchors, and its momentum if it has one
    momentum = state.momentum if fields == 2 and me == src else None
    peers = bad if me == src else [src] if me in bad else []
    bounds = slice_bounds(layout.numel, slice_count(headers), 1)
    pieces = [outer.chunk_bounds(b - a, chunk) if b > a else [] for a, b in bounds]
    owns = rank < len(bounds) and bounds[rank][1] > bounds[rank][0]
    taken = ([torch.empty_like(a) for a in state.anchors],
             [torch.empty_like(a) for a in state.anchors] if fields == 2 else None) if me in bad else None
    for k in range(max((len(p) for p in pieces), default=0)):
        parts = [(a + p[k][0], a + p[k][1]) if k < len(p) else (b, b) for (a, b), p in zip(bounds, pieces)]
        mine = None
        if me == src:  # the chunk of every slice of the state, at its owner
            sent = [layout.to_owners(state.anchors, parts, device, torch.device("cpu"))]
            if momentum is not None:
                sent.append(layout.to_owners(momentum, parts, device, torch.device("cpu")))
            mine = None if sent[0] is None else torch.cat(sent).view(torch.uint8)  # type: ignore[arg-type]
        got = None
        if owns:
            n = parts[rank][1] - parts[rank][0]
            if failed is not None and link is not None:  # the lanes' call count stays in step (MACs bind it)
                with suppress(Exception):
                    link.swap_bytes(torch.empty(0, dtype=torch.uint8), [])
            elif failed is None:
                try:
                    got = link.swap_bytes(mine if mine is not None else torch.empty(0, dtype=torch.uint8), peers,
                                          limit=4 * n * fields)
                except RoundLost as err:
                    failed = ("lost", str(err))
                except Exception as err:  # noqa: BLE001 - the island decides together (below)
                    failed = (type(err).__name__, f"{type(err).__name__}: {err}")
            if me in bad:
                values = got.get(src) if got is not None and failed is None else None
                if values is None or values.numel() != 4 * n * fields:
                    failed = failed or ("error", f"island {src} sent {0 if values is None else values.numel()} bytes "
                                                 f"of slice {rank}'s {n} values; run the same version everywhere")
                    values = torch.zeros(4 * n * fields, dtype=torch.uint8)
                got = {src: values}
        if taken is not None:
            flat = got[src].view(torch.float32) if got is not None else None
            n = parts[rank][1] - parts[rank][0] if owns else 0
            layout.from_owners(None if flat is None else flat[:n], parts, device, taken[0])
            if taken[1] is not None:
                layout.from_owners(None if flat is None else flat[n:], parts, device, taken[1])
    statuses = layout.group.all_gather_object(failed)
    problems = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if problems:
        _raise(side, problems)
    if taken is None:
        return len(bad)
    if side.is_leader:
        log.warning("islands: island %d's global state differs from island(s) %s's before round %d (%s vs %s); "
                    "taking island %d's, slice by slice", me, good, headers[src].round, headers[me].state, summary, src)
    rebase(locals_, state.anchors, taken[0], skip=set(state.indices(summary.fragment)))
    state.load_state_dict({"anchor": taken[0], "momentum": taken[1], "residual": state.residual,
                           "outer_steps": summary.outer_steps})
    state.write_to(locals_, state.indices(summary.fragment))
    return len(bad)


def _raise(side: Island, problems: list[tuple[int, tuple[str, str]]]) -> None:
    """Every rank: a lost slice leaves the island out of step (RoundLost: repaired at its next
    round); any other failure ends the island, the leader's message on every rank."""
    errors = [(r, m) for r, (kind, m) in problems if kind != "lost"]
    if not errors:
        raise RoundLost("; ".join(f"rank {r}'s slice of the repair: {m}" for r, (_, m) in problems))

    def fail() -> None:
        r, message = errors[0]
        raise RuntimeError(f"rank {r}'s slice of the repair failed: {message}")

    side.agree(fail)
