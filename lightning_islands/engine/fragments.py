"""Which parameters sync together: the model cut into fragments (Streaming DiLoCo).

A fragment is a set of whole parameters. Parameters of one block (``...blocks.3...``: the name up
to and including its first number) always travel together. ``strided`` deals the blocks out in
turn (fragment ``f`` gets blocks ``f, f + F, f + 2F, ...``), which Streaming DiLoCo found best, and
gives each parameter outside the blocks (embeddings, final norm) to the lightest fragment so far;
``sequential`` cuts the module order into ``F`` runs of about equal size. Both are deterministic
in the names and sizes alone, so every island cuts the same fragments whatever its sharding.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

LAYOUTS = ("strided", "sequential")
_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def block_key(name: str) -> str | None:
    """``"model.blocks.3.attn.wq.weight"`` -> ``"model.blocks.3"``; ``None`` outside numbered blocks."""
    found = _BLOCK.match(name)
    return found.group(1) if found else None


def _units(names: Sequence[str]) -> list[tuple[str | None, list[int]]]:
    """Parameters grouped in module order: one unit per block (its key and parameter indices),
    one per parameter outside the blocks (key ``None``)."""
    units: list[tuple[str | None, list[int]]] = []
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        key = block_key(name)
        if key is None:
            units.append((None, [i]))
        elif key in seen:
            units[seen[key]][1].append(i)
        else:
            seen[key] = len(units)
            units.append((key, [i]))
    return units


def split_fragments(names: Sequence[str], numels: Sequence[int], count: int,
                    layout: str = "strided") -> list[list[int]]:
    """Parameter indices of each of ``count`` fragments (each sorted; together every index once).

    Raises a ValueError naming the fix when the model has fewer units (blocks and parameters outside
    them) than fragments, or the layout is unknown.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"fragment_layout must be one of {LAYOUTS}, got {layout!r}")
    if count < 1:
        raise ValueError(f"fragments must be >= 1, got {count}")
    if len(names) != len(numels):
        raise ValueError(f"{len(names)} names but {len(numels)} sizes")
    if count == 1:
        return [list(range(len(names)))]
    units = _units(names)
    if len(units) < count:
        raise ValueError(f"the model has {len(units)} blocks and loose parameters, too few for {count} fragments; "
                         f"lower islands.fragments to at most {len(units)}")
    sizes = [sum(numels[i] for i in idx) for _, idx in units]
    chosen = _strided(units, sizes, count) if layout == "strided" else _sequential(sizes, count)
    fragments: list[list[int]] = [[] for _ in range(count)]
    for (_, idx), f in zip(units, chosen):
        fragments[f].extend(idx)
    if any(not frag for frag in fragments):  # strided with fewer blocks than fragments
        raise ValueError(f"the model has too few blocks to deal out {count} fragments ({layout}); lower "
                         "islands.fragments or use islands.fragment_layout=sequential")
    return [sorted(frag) for frag in fragments]


def _strided(units: Sequence[tuple[str | None, list[int]]], sizes: Sequence[int], count: int) -> list[int]:
    blocks = [u for u, (key, _) in enumerate(units) if key is not None]
    if not blocks:  # no numbered blocks: deal the parameters out in turn instead
        return [u % count for u in range(len(units))]
    chosen = [-1] * len(units)
    load = [0] * count
    for k, u in enumerate(blocks):
        chosen[u] = k % count
        load[k % count] += sizes[u]
    for u, (key, _) in enumerate(units):
        if key is None:
            lightest = min(range(count), key=lambda f: (load[f], f))
            chosen[u] = lightest
            load[lightest] += sizes[u]
    return chosen


def _sequential(sizes: Sequence[int], count: int) -> list[int]:
    """Contiguous runs of units, each closed once its running total reaches its share of the
    whole, and never so late that a later fragment would be left empty."""
    total, chosen, f, acc = sum(sizes), [], 0, 0
    for u, size in enumerate(sizes):
        left = len(sizes) - u  # units not yet placed, this one included
        if f < count - 1 and chosen and (acc >= total * (f + 1) / count or left == count - 1 - f):
            f += 1
        chosen.append(f)
        acc += size
    return chosen
