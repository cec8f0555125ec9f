"""The butterfly's repair: an island whose stage base differs from its group's source takes the
source's anchors, base and (if any) momentum of the round's fragment.

:meth:`~lightning_islands.engine.mixing.PendingMix.arrange` finds the repairs from the round's
headers; :func:`repair` moves the state once the round counted, before its mix lands (synchronous
and overlapped rounds alike, so that the islands' calls on the link stay in step): through the
leaders (a source gathers its fields to rank 0 and swaps them with the islands it repairs), or with
``exchange=sliced`` slice by slice, rank to rank
(:func:`~lightning_islands.engine.slice_moves.move_slices`), after the leaders swap how many fields
come (a source's momentum may not exist yet).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_islands.engine.header import RoundHeader
from lightning_islands.engine.slice_moves import move_slices, slice_count
from lightning_islands.link.protocol import Link

if TYPE_CHECKING:
    from lightning_islands.engine.lifecycle import IslandEngineBase
    from lightning_islands.engine.mixing import PendingMix

log = logging.getLogger(__name__)


def repair(engine: IslandEngineBase, mix: PendingMix, headers: Sequence[RoundHeader], repairs: dict[int, int],
           locals_: Sequence[Tensor]) -> None:
    """Each source sends the islands it repairs its anchors, base and (if any) momentum of the
    fragment; they take them (into ``locals_`` too) and the source's outer step count (every rank;
    a collective of the island). Through the leader, or with ``exchange=sliced`` slice by slice
    (:func:`~lightning_islands.engine.slice_moves.move_slices`)."""
    island, state, f = engine.island, engine.state, mix.fragment
    idx, opt = state.indices(f), state.optimizers[f]
    repaired = [bad for bad, src in repairs.items() if src == island]
    fields = [[state.anchors[i] for i in idx], [state.bases[mix.stage][i] for i in idx]]
    fields += [list(opt.buffers)] if opt.buffers and all(b is not None for b in opt.buffers) else []
    send = _through_slices if engine.sliced else _through_leader
    got = send(engine, mix, headers, repairs, repaired, fields)
    if got is None:
        return
    with torch.no_grad():
        for k, i in enumerate(idx):
            state.anchors[i].copy_(got[0][k])
            state.bases[mix.stage][i].copy_(got[1][k])
    state.write_to(locals_, idx)  # a round that only agrees to stop lands no mix: the island ends on these
    opt.buffers = [t.to(state.anchors[i].device) for t, i in zip(got[2], idx)] if len(got) == 3 else []
    summary = headers[repairs[island]].state
    steps = summary.outer_steps if summary is not None else opt.steps
    opt.steps = steps if isinstance(steps, int) else steps[f]
    if engine.is_leader:
        log.warning("islands: island %d's base of stage %d differs from island %d's before round %d; taking island "
                    "%d's global state", island, mix.stage, repairs[island], headers[island].round, repairs[island])


def _through_leader(engine: IslandEngineBase, mix: PendingMix, headers: Sequence[RoundHeader],
                    repairs: dict[int, int], repaired: list[int], fields: list[list[Tensor]]
                    ) -> list[list[Tensor]] | None:
    """The repair's transfer through the leaders: a source gathers its fields to rank 0 and swaps them
    with the islands it repairs, whose rank 0 scatters them. Returns a repaired island's fields."""
    island, layout = engine.island, engine.fragment_layouts[mix.fragment]
    peers = repaired or ([repairs[island]] if island in repairs else [])
    payload: Tensor | None = None
    if repaired:
        flats = [layout.gather_to_leader(p, engine.device) for p in fields]
        payload = None if flats[0] is None else torch.cat([t.cpu() for t in flats]).view(torch.uint8)  # type: ignore
    empty = torch.empty(0, dtype=torch.uint8)
    box: dict[int, Tensor] = {}

    def swap(link: Link) -> int:
        got = link.swap_bytes(payload if payload is not None else empty, peers, limit=12 * layout.numel)
        if island in repairs:
            box[0] = got[repairs[island]].view(torch.float32)
        return int(box[0].numel()) if box else 0

    count = engine.side.agree(lambda: swap(engine.link))  # type: ignore[arg-type]
    if island not in repairs:
        return None
    n, flat = layout.numel, box.get(0)
    _check_count(count // n if count % n == 0 else 0, repairs[island], island, mix.fragment, count, n)
    return [layout.scatter_from_leader(None if flat is None else flat[k * n : (k + 1) * n], engine.device)
            for k in range(count // n)]


def _through_slices(engine: IslandEngineBase, mix: PendingMix, headers: Sequence[RoundHeader],
                    repairs: dict[int, int], repaired: list[int], fields: list[list[Tensor]]
                    ) -> list[list[Tensor]] | None:
    """The repair's transfer with ``exchange=sliced``: the leaders swap how many fields each source
    sends (its momentum may not exist yet), then every rank moves its slice of them, rank to rank."""
    island, layout = engine.island, engine.fragment_layouts[mix.fragment]
    # this island's view of the transfers: a source sends to those it repairs, a repaired island
    # takes from its source, any other swaps with nobody (src -1)
    src = repairs.get(island, island if repaired else -1)
    takers = repaired or ([island] if island in repairs else [])
    peers = repaired or ([src] if island in repairs else [])

    def swap(link: Link) -> int:
        got = link.swap_bytes(torch.tensor([len(fields)] if repaired else [], dtype=torch.uint8), peers, limit=1)
        return int(got[src][0]) if island in repairs and got[src].numel() else 0

    count = engine.side.agree(lambda: swap(engine.link))  # type: ignore[arg-type]
    if island in repairs:
        _check_count(count, src, island, mix.fragment, count, layout.numel)
    slices = slice_count(headers)
    link, failed = engine.rank_lanes(slices)
    return move_slices(engine.side, layout, fields if repaired else None, count if island in repairs else len(fields),
                       fields[0], src, takers, slices=slices, link=link,
                       chunk=engine.settings.exchange_chunk, device=engine.device, failed=failed,
                       what=f"the repair of stage {mix.stage}")


def _check_count(fields: int, src: int, island: int, fragment: int, got: int, numel: int) -> None:
    """A repair brings the anchors and base, and the momentum if the source has one."""
    if fields not in (2, 3):
        raise RuntimeError(f"island {src} sent {got} values to repair island {island}'s fragment {fragment} of "
                           f"{numel}; run the same version and model on every island")
