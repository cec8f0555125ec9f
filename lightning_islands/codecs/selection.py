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


def _kth_largest(a: Tensor, k: int) -> Tensor:
    """The k-th largest entry of ``a`` (1 <= k <= n), as a 0-d tensor.

    ``torch.topk`` over the whole vector is slow on CPU (~0.1-0.5 GB/s), so for small k we first
    estimate a threshold from a strided sample (over-selecting about 2x), keep the candidates at
    or above it and run the exact top-k on those; if the estimate was too high to leave k
    candidates, fall back to the full ``torch.topk``. The value is unique whatever the route.
    """
    n = a.numel()
    if n < _TOPK_SAMPLE * 4 or 4 * k >= n:
        return torch.topk(a, k, sorted=False).values.min()
    sample = a[:: n // _TOPK_SAMPLE]
    rank = min(sample.numel(), 2 * ceil_div(k * sample.numel(), n) + 32)
    estimate = torch.topk(sample, rank, sorted=False).values.min()
    candidates = a[a >= estimate]
    if candidates.numel() < k:  # pragma: no cover - needs a very unlucky sample
        candidates = a
    return torch.topk(candidates, k, sorted=False).values.min()


def topk_indices(a: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries of ``a`` in increasing order. ``a`` holds magnitudes as
    :func:`magnitude_bits` (or any non-negative values without NaN).

    The selection rule: all entries above the k-th largest value, then the lowest-index entries
    equal to it until there are k.
    """
    threshold = _kth_largest(a, k)
    above = torch.nonzero(a > threshold).view(-1)
    ties = torch.nonzero(a == threshold).view(-1)[: k - above.numel()]
    return torch.cat([above, ties]).sort().values
