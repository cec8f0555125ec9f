"""Fragment sizes from a model's blocks: the ``strided`` and ``sequential`` layouts of ``islands.fragment_layout``.

A fragment is a set of transformer blocks. ``strided`` gives fragment ``f`` the blocks ``f, f + F,
f + 2F, ...`` (Streaming DiLoCo's better layout: every fragment spans the depth of the model);
``sequential`` gives it a contiguous run of blocks. With equal blocks both split the model evenly;
the planner's default (no sizes given) is an even split of the canonical vector.
"""

from __future__ import annotations

from collections.abc import Sequence

LAYOUTS = ("strided", "sequential")


def fragment_sizes(block_sizes: Sequence[int], fragments: int, layout: str = "strided",
                   rest: int = 0) -> tuple[int, ...]:
    """Values per fragment for blocks of ``block_sizes`` values, ``fragments`` fragments, ``layout``;
    ``rest`` (embeddings, final norm: what is in no block) is spread evenly over the fragments.

    Raises a ValueError when there are fewer blocks than fragments or the layout is unknown.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"islands.fragment_layout must be one of {LAYOUTS}, got {layout!r}")
    n = len(block_sizes)
    if fragments < 1 or n < fragments:
        raise ValueError(f"{n} blocks cannot make {fragments} fragments: each fragment needs a block; "
                         "lower islands.fragments")
    if rest < 0 or any(b < 0 for b in block_sizes):
        raise ValueError("block sizes and the rest must be >= 0")
    if layout == "strided":
        owners = [i % fragments for i in range(n)]
    else:
        per, extra = divmod(n, fragments)
        owners = []
        for f in range(fragments):
            owners += [f] * (per + (1 if f < extra else 0))
    sizes = [0] * fragments
    for owner, size in zip(owners, block_sizes):
        sizes[owner] += int(size)
    base, extra_rest = divmod(rest, fragments)
    return tuple(s + base + (1 if f < extra_rest else 0) for f, s in enumerate(sizes))
