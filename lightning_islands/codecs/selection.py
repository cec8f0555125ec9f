"""Which entries a top-k payload keeps: the k largest magnitudes, ties to the lowest indices.

The rule is the same on every path and device (:func:`topk_indices` is the torch reference;
:func:`native_topk` the fused CPU kernels), so the kept set, and the payload, are too.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
from torch import Tensor

from lightning_islands import native
from lightning_islands.buffers import Buffers, take
from lightning_islands.codecs.base import raise_if_nonfinite_sum
from lightning_islands.codecs.wire import ceil_div

_TOPK_SAMPLE = 1 << 15  # sample size for the top-k threshold estimate (torch path)
_TOPK_SAMPLE_RUN = 128  # the fused top-k samples runs of this many consecutive entries
_TOPK_BUCKET_SHIFT = 20  # the fused top-k's histogram buckets are |x| bits >> 20 ...
_TOPK_BUCKETS = 2048  # ... of which there are 2048
_INF_BITS = 0x7F800000
_TOPK_SLACK = 16  # the pick and the band kernels store whole 16-entry blocks: this many spare slots
_BAND_BUCKET_BITS = 12  # liq_topk_band_hist's 4096 buckets (LIQ_BAND_BUCKETS)
_PIECE_MIN = 1 << 15  # picked entries per piece at least: fewer are not worth a thread


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
    """Indices of the k largest entries of ``a`` in increasing order; torch path. ``a`` holds
    magnitudes as :func:`magnitude_bits` (or any non-negative values without NaN).

    The selection rule, shared with the fused kernel and every device: all entries above the
    k-th largest value, then the lowest-index entries equal to it until there are k.
    """
    threshold = _kth_largest(a, k)
    above = torch.nonzero(a > threshold).view(-1)
    ties = torch.nonzero(a == threshold).view(-1)[: k - above.numel()]
    return torch.cat([above, ties]).sort().values


NATIVE_TOPK_MAX = 1 << 31  # the fused top-k's indices are int32: vectors up to this long


def native_topk(x: Tensor, k: int, scratch: Buffers | None = None) -> tuple[Tensor, Tensor]:
    """(indices, values) of the top-k magnitudes of ``x`` with the fused kernels; same rule as
    :func:`topk_indices`, the indices int32 (``x`` has at most :data:`NATIVE_TOPK_MAX` entries).
    Usually one pass over ``x``, split across the kernel threads, that picks every entry at or
    above a band of magnitudes guessed from a sample (with the band's count, the threshold
    follows); a poor guess costs a histogram pass that finds the band exactly, and a second pick.
    Temporaries, and the results, come from ``scratch`` if given (valid until it is asked for them
    again)."""
    n = x.numel()
    if n > NATIVE_TOPK_MAX:
        raise ValueError(f"the fused top-k takes at most {NATIVE_TOPK_MAX} entries (int32 indices), got {n}")
    ranges = native.split(n, 1)
    guess = _sampled_band(x, k)
    if guess is not None:
        lo, hi, expected = guess
        # a range may hold any share of the k largest and of the band (layers differ in scale): room for
        # all of both (the pages of unused room are never touched)
        caps = [min(e - s, k + expected + 256) + _TOPK_SLACK for s, e in ranges]
        found = _band_pick(x, k, ranges, lo, hi, caps, scratch)
        if found is not None:
            return found
    hist = torch.zeros(len(ranges), _TOPK_BUCKETS, dtype=torch.int64)
    status = native.run_jobs([("liq_topk_hist", (native.ptr(x, s), e - s, native.ptr(hist[r])))
                              for r, (s, e) in enumerate(ranges)])
    if any(st < 0 for st in status):
        raise MemoryError("fused top-k could not allocate its histogram")
    if any(status):
        raise_if_nonfinite_sum(x)  # raises: the kernel saw a NaN/Inf
    from_top = hist.sum(0).flip(0).cumsum(0)
    bucket = _TOPK_BUCKETS - 1 - int(torch.searchsorted(from_top, k))  # first bucket reaching k
    shift = _TOPK_BUCKET_SHIFT
    caps = (hist[:, bucket:].sum(1) + _TOPK_SLACK).tolist()  # exactly the entries >= the bucket, per range
    found = _band_pick(x, k, ranges, bucket << shift, (bucket + 1) << shift, caps, scratch)
    if found is None:  # pragma: no cover - the bucket holds the k-th largest by construction
        raise RuntimeError("fused top-k: the histogram bucket does not hold the threshold")
    return found


def _sampled_band(x: Tensor, k: int) -> tuple[int, int, int] | None:
    """A band [lo, hi) of |x| bit patterns likely to hold the k-th largest magnitude, and about how
    many entries fall inside it, from a sample (contiguous runs spread evenly over ``x``, which
    is cheaper to read than a strided sample); None for short vectors."""
    n = x.numel()
    if n < 8 * _TOPK_SAMPLE:
        return None
    runs = _TOPK_SAMPLE // _TOPK_SAMPLE_RUN  # the first entries of each of `runs` equal slices of x
    grid = x[: runs * (n // runs)].view(runs, n // runs)[:, :_TOPK_SAMPLE_RUN]
    sample = magnitude_bits(grid.reshape(-1)).numpy()
    m = sample.size
    mean = m * k / n  # expected sample entries at or above the threshold
    margin = 4.0 * math.sqrt(mean) + 8
    top, bottom = math.floor(mean - margin), math.ceil(mean + margin)  # ranks from the largest
    ranked = np.partition(sample, [m - 1 - r for r in (bottom, top) if 0 <= r < m])  # ascending at those
    hi = int(ranked[m - 1 - top]) + 1 if top >= 0 else _INF_BITS
    lo = int(ranked[m - 1 - bottom]) if bottom < m else 0
    inside = int(np.count_nonzero((sample >= lo) & (sample < hi)))
    return lo, hi, ceil_div(n * (inside + 16), m) * 3 // 2


def _band_pick(x: Tensor, k: int, ranges: list[tuple[int, int]], lo: int, hi: int, caps: list[int],
               scratch: Buffers | None) -> tuple[Tensor, Tensor] | None:
    """The top-k of ``x`` if the k-th largest magnitude lies in the band [lo, hi) of bit patterns
    and each range has at most ``caps[r] - _TOPK_SLACK`` entries at or above ``lo``; else None.

    After the pick, the work on the picked entries is split evenly across the kernel threads
    (ranges of ``x`` may hold very different shares of them: layers differ in scale). The entries
    inside the band are drawn out, a histogram of them finds the one bucket that holds the
    threshold, and that bucket's entries give it exactly; then each piece counts its entries above
    and at the threshold and keeps them into its own part of the output."""
    starts = [0, *itertools.accumulate(caps)]
    idx_all = take(scratch, "topk.picked_idx", starts[-1], torch.int32)
    val_all = take(scratch, "topk.picked_val", starts[-1])
    above = torch.zeros(len(ranges), dtype=torch.int64)
    got = native.run_jobs([("liq_topk_pick", (native.ptr(x, s), e - s, s, lo, hi, native.ptr(idx_all, starts[r]),
                                              native.ptr(val_all, starts[r]), caps[r], native.ptr(above, r)))
                           for r, (s, e) in enumerate(ranges)])
    if any(g == -2 for g in got):
        raise_if_nonfinite_sum(x)  # raises: the kernel saw a NaN/Inf
    n_above = int(above.sum())
    if any(g < 0 for g in got) or not n_above < k <= sum(got):
        return None
    pieces = _pieces([(starts[r], g) for r, g in enumerate(got)])
    each = range(len(pieces))
    room = [0, *itertools.accumulate(m + _TOPK_SLACK for _, m in pieces)]  # the kernels store 16 at a time
    band = take(scratch, "topk.band", room[-1], torch.int32)
    inside = native.run_jobs([("liq_topk_band_bits", (native.ptr(val_all, at), m, lo, hi, native.ptr(band, room[p])))
                              for p, (at, m) in enumerate(pieces)])
    if sum(inside) != sum(got) - n_above:  # pragma: no cover - would be a kernel bug
        raise RuntimeError(f"fused top-k: {sum(inside)} entries inside the band, the pick says {sum(got) - n_above}")
    shift = max(0, (hi - lo - 1).bit_length() - _BAND_BUCKET_BITS)
    hist = torch.zeros(len(pieces), 1 << _BAND_BUCKET_BITS, dtype=torch.int64)
    beyond = native.run_jobs([("liq_topk_band_hist", (native.ptr(band, room[p]), inside[p], lo, hi, shift,
                                                       native.ptr(hist[p]))) for p in each])
    if any(beyond):  # pragma: no cover - would be a kernel bug: the band holds only entries below hi
        raise RuntimeError(f"fused top-k: {sum(beyond)} entries drawn out of the band lie above it")
    rank = k - n_above  # the threshold is the rank-th largest entry inside the band
    from_top = hist.sum(0).flip(0).cumsum(0)
    top = int(torch.searchsorted(from_top, rank))  # buckets counted from the top, to the one reaching rank
    bucket = hist.shape[1] - 1 - top
    higher = int(from_top[top - 1]) if top else 0  # band entries in buckets above it
    b_lo, b_hi = lo + (bucket << shift), min(hi, lo + ((bucket + 1) << shift))
    counts = hist[:, bucket].tolist()
    slots = [0, *itertools.accumulate(c + _TOPK_SLACK for c in counts)]
    bits = take(scratch, "topk.bucket", slots[-1], torch.int32)
    found = native.run_jobs([("liq_topk_band_bits", (native.ptr(band, room[p]), inside[p], b_lo, b_hi,
                                                     native.ptr(bits, slots[p]))) for p in each])
    if found != counts:  # pragma: no cover - would be a kernel bug
        raise RuntimeError(f"fused top-k: {found} entries in the threshold's bucket, the histogram says {counts}")
    arrays = bits.numpy()
    joined = np.concatenate([arrays[slots[p] : slots[p] + counts[p]] for p in each])
    place = joined.size - (rank - higher)  # the threshold's place in its bucket, sorted ascending
    threshold = int(np.partition(joined, place)[place])
    equal = torch.zeros(len(pieces), dtype=torch.int64)
    greater = native.run_jobs([("liq_topk_count", (native.ptr(val_all, at), m, threshold, native.ptr(equal, p)))
                               for p, (at, m) in enumerate(pieces)])
    ties, want = _shares(greater, equal.tolist(), k)
    out = [0, *itertools.accumulate(want)]
    idx = take(scratch, "topk.idx", k, torch.int32)
    vals = take(scratch, "topk.vals", k)
    left = torch.tensor(ties, dtype=torch.int64)  # the kernels count them down
    kept = native.run_jobs([("liq_topk_keep", (native.ptr(idx_all, at), native.ptr(val_all, at), m, threshold,
                                               native.ptr(left, p), want[p], native.ptr(idx, out[p]),
                                               native.ptr(vals, out[p]))) for p, (at, m) in enumerate(pieces)])
    if kept != want:  # pragma: no cover - would be a kernel bug
        raise RuntimeError(f"fused top-k kept {kept} entries per piece, expected {want} (k={k})")
    return idx, vals


def _pieces(parts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The picked entries, given as ``(offset, count)`` parts in index order (one per range), cut
    into pieces of ``total / threads`` entries (at least ``_PIECE_MIN``; a part's last piece may be
    shorter), none across two parts, so at most as many pieces as threads plus parts; the pieces
    as ``(offset, count)``, in index order."""
    total = sum(m for _, m in parts)
    per = max(_PIECE_MIN, ceil_div(total, max(1, torch.get_num_threads())))
    return [(at + s, min(per, m - s)) for at, m in parts for s in range(0, m, per)]


def _shares(greater: list[int], equal: list[int], k: int) -> tuple[list[int], list[int]]:
    """Per piece of the picked entries, in index order: how many entries equal to the threshold it
    keeps, and how many entries in all (every entry above the threshold, then ties while the k are
    not complete: ties go to the lowest indices, so to the earlier pieces first), from each piece's
    count of entries above (``greater``) and equal to (``equal``) the threshold. So each piece can
    keep its entries into its own part of the output, concurrently with the others."""
    left = k - sum(greater)
    ties = []
    for e in equal:
        ties.append(min(e, left))
        left -= ties[-1]
    if left:  # pragma: no cover - the threshold is the k-th largest by construction
        raise RuntimeError(f"fused top-k: {left} of k={k} entries are missing at the threshold")
    return ties, [g + t for g, t in zip(greater, ties)]
