"""One island's state sent to others slice by slice: :func:`move_slices`.

Whatever one island sends another whole (the repair of a drifted island, the state every island
takes from island 0 at the start, a butterfly group's repair) goes, with ``exchange=sliced``, the
way a round's payloads go: the canonical vector is cut into ``S`` slices (the ranks of the smallest
island present) and moved a chunk at a time; the source island moves chunk ``k`` of each slice of
every field (anchors, momentum, ...) to the slice's owner (:meth:`CanonicalLayout.to_owners`), each
owner swaps it over its own lanes with the same rank of the islands that take it, and there the
owner sends it back to the shards (:meth:`CanonicalLayout.from_owners`). No rank holds more than
one chunk of its slice of each field. Every owner of every island swaps once per chunk (with nobody
when its island neither sends nor takes), so that the lanes' sequences of payloads stay in step.
After the last chunk the island learns every slice's outcome at once: a lost transfer is
:class:`~lightning_islands.link.protocol.RoundLost` on every rank, any other failure a
``RuntimeError`` on every rank that names the rank and its slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress
from typing import Any

import torch
from torch import Tensor

from lightning_islands.engine import outer
from lightning_islands.engine.header import RoundHeader
from lightning_islands.engine.island import Island
from lightning_islands.engine.layout import CanonicalLayout
from lightning_islands.link.protocol import RoundLost


def slice_bounds(numel: int, count: int, alignment: int) -> list[tuple[int, int]]:
    """``count`` contiguous ranges covering ``[0, numel)`` in order, each starting on a multiple of
    ``alignment`` (whole codec blocks), as even as whole blocks allow (the last ones empty when there
    are fewer blocks than slices, so that rank 0, which reports the round, always owns one)."""
    if count < 1 or alignment < 1:
        raise ValueError(f"count and alignment must be >= 1, got {count} and {alignment}")
    blocks = -(-numel // alignment)
    base, extra = divmod(blocks, count)  # the first ``extra`` slices take one block more; any empty ones come last
    cuts = [min(numel, (base * k + min(k, extra)) * alignment) for k in range(count + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def slice_count(headers: Sequence[RoundHeader]) -> int:
    """How many slices a round cuts: the ranks of the smallest island present."""
    return min(h.ranks for h in headers if not h.absent)


def chunk_parts(bounds: Sequence[tuple[int, int]], chunk: int | None) -> list[list[tuple[int, int]]]:
    """The slices ``bounds`` moved ``chunk`` values at a time (``None``: each at once), side by side:
    for each step ``k`` every slice's chunk ``k`` (an empty range at its end once it has none left)."""
    pieces = [outer.chunk_bounds(b - a, chunk) if b > a else [] for a, b in bounds]
    return [[(a + p[k][0], a + p[k][1]) if k < len(p) else (b, b) for (a, b), p in zip(bounds, pieces)]
            for k in range(max((len(p) for p in pieces), default=0))]


def move_slices(side: Island, layout: CanonicalLayout, fields: Sequence[Sequence[Tensor]] | None, count: int,
                like: Sequence[Tensor], src: int, takers: Sequence[int], *, slices: int, link: Any,
                chunk: int | None, device: torch.device, failed: tuple[str, str] | None = None,
                what: str = "the state") -> list[list[Tensor]] | None:
    """Island ``src`` sends ``fields`` (each a list of tensors shaped like this rank's shards, read on
    ``src`` only) to the islands ``takers``, slice by slice (module docstring); a collective of the
    island, called by every island of the round alike.

    ``count``: how many fields (every island must know it); ``like``: tensors shaped like this
    rank's shards, on their devices (a taker's received fields take their shapes, fp32); ``slices``:
    how many slices (the ranks of the smallest island present, alike on every island); ``link``:
    this rank's lanes (the island's link on rank 0, its RankLink on ranks ``1..S-1``, ``None``
    beyond); ``chunk``: values per chunk of a slice (``None``: each slice at once); ``failed``: this
    rank's lanes could not be built; ``what``: names the transfer in errors. Returns, on a taker,
    the fields received; elsewhere ``None``. Each island passes its own view of the transfers, which
    must agree (a source its takers, a taker its source, any other island ``src=-1``, no takers), so
    several sources may send at once (the butterfly's groups)."""
    me, rank = side.index, layout.group.rank
    peers = list(takers) if me == src else [src] if me in takers else []
    bounds = slice_bounds(layout.numel, slices, 1)
    owns = rank < len(bounds) and bounds[rank][1] > bounds[rank][0]
    taken = [[torch.empty_like(t, dtype=torch.float32) for t in like] for _ in range(count)] if me in takers else None
    for parts in chunk_parts(bounds, chunk):
        n = parts[rank][1] - parts[rank][0] if owns else 0
        mine = None
        if me == src:  # the chunk of every slice of every field, at its owner
            assert fields is not None and len(fields) == count, "the source sends every field"
            sent = [layout.to_owners(f, parts, device, torch.device("cpu")) for f in fields]
            mine = None if sent[0] is None else torch.cat(sent).view(torch.uint8)  # type: ignore[arg-type]
        got = None
        if owns:
            got, failed = _swap(link, mine, peers, 4 * n * count, failed)
            if me in takers:
                values = got.get(src) if got is not None and failed is None else None
                if values is None or values.numel() != 4 * n * count:
                    failed = failed or ("error", f"island {src} sent {0 if values is None else values.numel()} bytes "
                                                 f"of slice {rank}'s {n} values of {what}; run the same version "
                                                 "everywhere")
                    values = torch.zeros(4 * n * count, dtype=torch.uint8)
                got = {src: values}
        if taken is not None:
            flat = got[src].view(torch.float32) if got is not None else None
            for j, into in enumerate(taken):
                layout.from_owners(None if flat is None else flat[j * n : (j + 1) * n], parts, device, into)
    statuses = layout.group.all_gather_object(failed)
    problems = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if problems:
        _raise(side, problems, what)
    return taken


def _swap(link: Any, mine: Tensor | None, peers: list[int], limit: int, failed: tuple[str, str] | None
          ) -> tuple[dict[int, Tensor] | None, tuple[str, str] | None]:
    """This owner's swap of one chunk (with nobody when its island neither sends nor takes); after
    a failure the lanes still see the call, so that their count of payloads stays in step."""
    empty = torch.empty(0, dtype=torch.uint8)
    if failed is not None:
        if link is not None:
            with suppress(Exception):
                link.swap_bytes(empty, [])
        return None, failed
    try:
        return link.swap_bytes(mine if mine is not None else empty, peers, limit=limit), None
    except RoundLost as err:
        return None, ("lost", str(err))
    except Exception as err:  # noqa: BLE001 - the island decides together
        return None, (type(err).__name__, f"{type(err).__name__}: {err}")


def _raise(side: Island, problems: list[tuple[int, tuple[str, str]]], what: str) -> None:
    """Every rank: a lost slice is RoundLost; any other failure a RuntimeError, the leader's message
    on every rank."""
    errors = [(r, m) for r, (kind, m) in problems if kind != "lost"]
    if not errors:
        raise RoundLost("; ".join(f"rank {r}'s slice of {what}: {m}" for r, (_, m) in problems))

    def fail() -> None:
        r, message = errors[0]
        raise RuntimeError(f"rank {r}'s slice of {what} failed: {message}")

    side.agree(fail)
