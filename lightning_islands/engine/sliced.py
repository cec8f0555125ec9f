"""The sliced exchange: every rank moves its own slice of the fragment (``islands.exchange=sliced``).

Through the leader (``exchange=leader``) an island's rank 0 gathers the whole fragment, encodes,
exchanges, decodes and merges it, and scatters the result: its host holds the fragment and carries
all of its bytes. Sliced, the fragment's canonical vector is cut into ``S`` slices on codec blocks,
``S`` the ranks of the smallest island present (every island reads it from the headers), and rank
``r < S`` of every island owns slice ``r``:

a chunk at a time (``exchange_chunk_mib`` within a slice), every slice's chunk ``k`` side by side:

1. the island moves chunk ``k`` of each slice to its owner over its own fabric, all at once
   (:meth:`CanonicalLayout.to_owners`, an all-to-all of the ranks' pieces, which are neither
   contiguous nor block-aligned in the canonical order);
2. each owner runs the leader path's :class:`~lightning_islands.engine.exchange.ChunkExchange` on it
   over its own lanes to the owners of the same slice in the other islands (rank 0's are the
   island's link; the others' a :class:`~lightning_islands.link.protocol.RankLink`), so the slices
   move in parallel;
3. each owner sends the merged chunk, and what the codec dropped from it (error feedback), back to
   the shards (:meth:`CanonicalLayout.from_owners`, the reverse all-to-all);
4. after the last chunk the island learns whether every slice moved (one object all-gather: a lost
   transfer anywhere runs the round again on every island, any other failure ends it as the
   leader's would).

The merge is elementwise and in island order, and the slices fall on codec blocks, so a codec that
quantizes block by block gives the leader path's bits. A codec that selects (top-k) selects within
each slice's chunks, as the leader path does within each chunk: a slice is a chunk of its own, and
the result equals the leader path's when its chunks are the slices. Every island cuts the same
slices from the same headers, so the global state stays bit-identical across islands whatever their
ranks. Ranks ``>= S`` of a larger island own no slice: they send their pieces and receive the
results. A rank holds one chunk of its slice and that chunk's temporaries, never the fragment.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_islands.codecs import Codec
from lightning_islands.engine.exchange import LINK_TOTALS, ChunkExchange
from lightning_islands.engine.island import Island
from lightning_islands.engine.layout import CanonicalLayout
from lightning_islands.engine.merging import MergePlan
from lightning_islands.engine.mixing import MixExchange
from lightning_islands.engine.slice_moves import chunk_parts, slice_bounds
from lightning_islands.link.protocol import (
    AuthenticationError,
    CoordinatorLost,
    DeadlinePassed,
    IslandAborted,
    RoundLost,
)


@dataclass
class SliceResult:
    """What one rank's slice exchange left: the merged values scattered into shard-shaped tensors
    (every rank) and, on the leader, the island's summed exchange (its stats and link totals)."""

    grads: list[Tensor]
    exchange: ChunkExchange | MixExchange | None
    chunks: int


def exchange_sliced(side: Island, layout: CanonicalLayout, codec: Codec, link: Any, plan: MergePlan,
                    sent: Sequence[Tensor], anchors: Sequence[Tensor], residual: Sequence[Tensor] | None,
                    delta_sq: float, count: int, chunk: int | None, device: torch.device,
                    exchange_device: torch.device, failed: tuple[str, str] | None = None,
                    mix: Callable[[Any], MixExchange] | None = None) -> SliceResult:
    """One round's sliced exchange on this rank (module docstring): a collective of the island.

    ``link``: this rank's lanes (the island's link on rank 0, a RankLink on ranks ``1..count-1``,
    ``None`` beyond); ``sent``: this rank's shards of what the island sends (pseudo-gradient plus
    decayed residual); ``anchors``: shard-shaped tensors the results take the shape of;
    ``residual``: this rank's error-feedback residual shards, overwritten with what the codec
    dropped (``None`` without error feedback); ``count``: the round's slices; ``chunk``: values per
    chunk within a slice (``None``: each slice at once); ``failed``: this rank failed before the
    exchange (``("lost", why)`` when its lanes could not be built), so it moves nothing.

    The slices move a chunk at a time, all of them side by side: chunk ``k`` of every slice goes to
    its owner, moves between the islands and comes back before chunk ``k + 1`` is gathered, so a rank
    holds one chunk of its slice and one chunk's temporaries. An owner whose transfer failed goes on
    taking part in the island's chunk loop without moving anything (its chunks' results are not used:
    the round ends in an error or runs again; what the codec dropped is written as zeros there)."""
    group, rank = layout.group, layout.group.rank
    bounds = slice_bounds(layout.numel, count, codec.alignment)
    steps = chunk_parts(bounds, chunk)
    owns = rank < len(bounds) and bounds[rank][1] > bounds[rank][0]
    others = sum(not h.absent for h in plan.headers) > 1
    if failed is None and owns and link is None and others:  # it would merge this slice with nobody's
        failed = ("error", f"rank {rank} of island {side.index} has no lanes of its own for exchange=sliced (the "
                           "engine met the other islands without open_rank_link)")
    exchange: ChunkExchange | MixExchange | None = None
    if owns and failed is None:
        exchange = (ChunkExchange(codec, link, side.index, plan, layout, delta_sq, residual is not None) if mix is None
                    else mix(link))
    grads = [torch.zeros_like(a) for a in anchors]
    beat = side.link.beating({"sliced": "moving the island's slices"}) if side.is_leader and side.link else None
    with beat if beat is not None else nullcontext():
        for parts in steps:
            part = layout.to_owners(sent, parts, device, exchange_device)
            merged, dropped = part, None
            if part is not None:  # this rank owns chunk k of its slice
                if failed is None and exchange is not None:
                    try:
                        merged, dropped = exchange.run(part, parts[rank][0])
                    except RoundLost as err:
                        failed = ("lost", str(err))
                    except Exception as err:  # noqa: BLE001 - the island decides together (below)
                        failed = (type(err).__name__, f"{type(err).__name__}: {err}")
                if failed is not None:
                    dropped = torch.zeros_like(part) if residual is not None else None
            if residual is not None:
                layout.from_owners(dropped, parts, device, residual)
            layout.from_owners(merged, parts, device, grads)
            del part, merged, dropped  # before the next chunk's pieces arrive
        if exchange is not None:
            exchange.release()
        statuses = group.all_gather_object(failed)
    problems = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if problems:
        side.agree(lambda: _raise(side, problems))
    chunks = _sum_stats(group, exchange, sum(p[rank][0] < p[rank][1] for p in steps) if owns else 0)
    return SliceResult(grads, exchange if side.is_leader else None, chunks)


def _raise(side: Island, failed: list[tuple[int, tuple[str, str]]]) -> None:
    """The leader's verdict on slices that did not move: lost ones run the round again on every
    island (the attempt is marked failed; past the round's deadline it ends), any other failure ends
    the island as the leader's would, with the failure's own class where the round cares (a lost
    coordinator, a deadline, a refused MAC)."""
    errors = [(r, kind, m) for r, (kind, m) in failed if kind != "lost"]
    if errors:
        r, kind, message = errors[0]
        raise ERROR_KINDS.get(kind, RuntimeError)(f"rank {r}'s slice exchange failed: {message}")
    why = "; ".join(f"rank {r}'s slice: {m}" for r, (_, m) in failed)
    if side.link is None:
        raise RoundLost(why)
    raise side.link.fail_round(why)


ERROR_KINDS: dict[str, type[Exception]] = {cls.__name__: cls for cls in (CoordinatorLost, IslandAborted, DeadlinePassed,
                                                                   AuthenticationError)}


def _sum_stats(group: Any, exchange: ChunkExchange | MixExchange | None, chunks: int) -> int:
    """Combine every rank's exchange statistics and link totals into the leader's ``exchange`` (the
    round's metrics then read as the leader path's): counts, bytes and sums add up; the seconds
    spent exchanging and waiting are the slowest rank's, the slices having moved side by side.
    Returns the island's chunk count."""
    if exchange is None:
        mine = None
    else:
        stats = exchange.stats
        mine = [float(chunks), float(stats.numel), float(stats.payload_bytes),
                *[exchange.link_sums[k] for k in LINK_TOTALS], *_stats_values(exchange)]
    rows = [r for r in group.all_gather_object(mine) if r is not None]
    if not rows:  # an empty fragment: no rank owned anything
        return 0
    total = [math.fsum(column) for column in zip(*rows)]
    for k, key in enumerate(LINK_TOTALS):
        if key.startswith("seconds"):
            total[3 + k] = max(r[3 + k] for r in rows)
    if exchange is not None and group.rank == 0:
        exchange.stats.numel, exchange.stats.payload_bytes = int(total[1]), int(total[2])
        exchange.link_sums = dict(zip(LINK_TOTALS, total[3 : 3 + len(LINK_TOTALS)]))
        _load_stats(exchange, total[3 + len(LINK_TOTALS):])
    return int(total[0])


def _stats_values(exchange: ChunkExchange | MixExchange) -> list[float]:
    s = exchange.stats
    spread = list(exchange.spread_sq.values()) if isinstance(exchange, MixExchange) else []
    return [s.sent_sq, s.error_sq, s.merged_sq, *s.decoded_sq, *s.dots.values(), *spread]


def _load_stats(exchange: ChunkExchange | MixExchange, values: Sequence[float]) -> None:
    s, n, d = exchange.stats, len(exchange.stats.decoded_sq), len(exchange.stats.dots)
    s.sent_sq, s.error_sq, s.merged_sq = values[0], values[1], values[2]
    s.decoded_sq = list(values[3 : 3 + n])
    s.dots = dict(zip(s.dots, values[3 + n : 3 + n + d]))
    if isinstance(exchange, MixExchange):  # the squared distances to each partner, summed over the slices
        exchange.spread_sq = dict(zip(exchange.spread_sq, values[3 + n + d :]))
