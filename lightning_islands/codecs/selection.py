"""Which entries a top-k payload keeps: the k largest magnitudes, ties to the lowest indices.

The rule does not depend on the device or on how a library orders a reduction, so the kept set,
and the payload, are the same everywhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_islands.codecs.wire import ceil_div

_TOPK_SAMPLE = 1 << 15  # sample size for the top-k threshold estimate


def magnitude_bits(x: Tensor) -> Tensor:
    """|x| as int32 bit patterns: for finite x they order exactly as the magnitudes, and unlike a
    float comparison they do not depend on a flush-to-zero mode (subnormals stay above zero)."""
    return x.view(torch.int32) & 0x7FFFFFFF


def _candidates(a: Tensor, k: int) -> Tensor | None:
    """Increasing indices of a subset of ``a`` that holds its k largest entries (about 2k of them),
    or None to search all of ``a``.

    ``torch.topk`` over the whole vector is slow on CPU, so for small k the threshold is first
    estimated from a strided sample (over-selecting about 2x); the entries at or above the estimate
    are the candidates. If the estimate was too high to leave k of them, None.
    """
    n = a.numel()
    if n < _TOPK_SAMPLE * 4 or 4 * k >= n:
        return None
    sample = a[:: n // _TOPK_SAMPLE]
    rank = min(sample.numel(), 2 * ceil_div(k * sample.numel(), n) + 32)
    estimate = torch.topk(sample, rank, sorted=False).values.min()
    idx = torch.nonzero(a >= estimate).view(-1)
    return idx if idx.numel() >= k else None  # fewer: needs a very unlucky sample


def topk_indices(a: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries of ``a`` (1 <= k <= n) in increasing order. ``a`` holds
    magnitudes as :func:`magnitude_bits` (or any non-negative values without NaN).

    The selection rule: all entries above the k-th largest value, then the lowest-index entries
    equal to it until there are k. (The candidates of :func:`_candidates` hold every entry at or
    above that value, so the result does not depend on the sample.)
    """
    idx = _candidates(a, k)
    values = a if idx is None else a.index_select(0, idx)
    threshold = torch.topk(values, k, sorted=False).values.min()
    kept = torch.nonzero(values >= threshold).view(-1)  # every entry above it and every tie, in order
    if kept.numel() > k:  # too many ties: keep the lowest-index ones
        tie = values.index_select(0, kept) == threshold
        allowed = k - (kept.numel() - int(tie.sum()))
        kept = kept[~tie | (torch.cumsum(tie, 0) <= allowed)]
    return kept if idx is None else idx.index_select(0, kept)
