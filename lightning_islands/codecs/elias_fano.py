"""Elias-Fano coding of the strictly increasing indices a top-k payload carries.

Its size depends only on ``(n, k)`` (see :mod:`lightning_islands.codecs.wire`), so a payload's
length stays an exact formula.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from lightning_islands import native
from lightning_islands.buffers import Buffers, take
from lightning_islands.codecs import paths
from lightning_islands.codecs.wire import ceil_div

_NATIVE_MAX = 1 << 31  # the C encoder reads int32 indices: vectors of at most this many entries


def ef_layout(n: int, k: int) -> tuple[int, int, int]:
    """(low bit count l, low-part bytes, high-part bytes) of Elias-Fano for k of n indices."""
    if k == 0:
        return 0, 0, 0
    low = (n // k).bit_length() - 1  # floor(log2(n / k)) for n >= k >= 1
    high_bits = k + ((n - 1) >> low) + 1
    return low, ceil_div(k * low, 8), ceil_div(high_bits, 8)


def _pack_bits(bits: Tensor, nbytes: int) -> Tensor:
    """uint8 0/1 vector -> bytes, LSB first; zero-padded to ``nbytes``."""
    pad = nbytes * 8 - bits.numel()
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=bits.device)
    return (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(data: Tensor) -> Tensor:
    """bytes -> uint8 0/1 vector, LSB first (inverse of :func:`_pack_bits`)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=data.device)
    return ((data.unsqueeze(1) >> shifts) & 1).view(-1)


def ef_encode(idx: Tensor, n: int, out: Tensor) -> None:
    """Elias-Fano code strictly increasing indices (int32 or int64) into ``out`` (exactly the layout size)."""
    k = idx.numel()
    low, low_bytes, high_bytes = ef_layout(n, k)
    if k == 0:
        return
    if paths.kernels(out) is not None and n <= _NATIVE_MAX:  # in parts, on the kernel threads
        idx = idx.to(torch.int32).contiguous()  # the kernels read int32 (the fused top-k's indices)
        parts = max(1, len(native.split(k, 8)))
        native.run_jobs([("liq_ef_encode_part", (native.ptr(idx), k, low, native.ptr(out), low_bytes,
                                                 native.ptr(out, low_bytes), high_bytes, part, parts))
                         for part in range(parts)])
        return
    if low:
        shifts = torch.arange(low, dtype=torch.int64, device=idx.device)
        bits = ((idx.unsqueeze(1) >> shifts) & 1).to(torch.uint8).view(-1)
        out[:low_bytes].copy_(_pack_bits(bits, low_bytes))
    positions = (idx >> low) + torch.arange(k, dtype=torch.int64, device=idx.device)
    unary = torch.zeros(high_bytes * 8, dtype=torch.uint8, device=idx.device)
    unary[positions] = 1
    out[low_bytes:].copy_(_pack_bits(unary, high_bytes))


def ef_decode(data: Tensor, n: int, k: int, scratch: Buffers | None = None) -> Tensor:
    """The k int64 indices below n that :func:`ef_encode` wrote into ``data``; ValueError naming the
    fault if the block does not hold k strictly increasing indices below n. On the fused path the
    result comes from ``scratch`` if given (valid until it is asked for it again)."""
    low, low_bytes, high_bytes = ef_layout(n, k)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device)
    if paths.kernels(data) is not None:
        return _native_decode(data.contiguous(), n, k, low, low_bytes, high_bytes, scratch)
    positions = torch.nonzero(_unpack_bits(data[low_bytes : low_bytes + high_bytes])).view(-1)
    if positions.numel() != k:
        raise ValueError(f"corrupt top-k index block: {positions.numel()} index marks, expected {k}")
    idx = (positions - torch.arange(k, dtype=torch.int64, device=data.device)) << low
    if low:
        bits = _unpack_bits(data[:low_bytes])[: k * low].view(k, low).to(torch.int64)
        shifts = torch.arange(low, dtype=torch.int64, device=data.device)
        idx |= (bits << shifts).sum(dim=1)
    if int(idx[-1]) >= n or (k > 1 and not bool((idx[1:] > idx[:-1]).all())):
        raise ValueError(f"corrupt top-k index block: indices not strictly increasing below n={n}")
    return idx


def _native_decode(data: Tensor, n: int, k: int, low: int, low_bytes: int, high_bytes: int,
                   scratch: Buffers | None) -> Tensor:
    """:func:`ef_decode` with the fused kernels, in parts of the high part on the kernel threads: the
    marks before each part are counted first (so each part knows the number of its first index),
    then every part decodes its indices into place."""
    parts = native.split(high_bytes, 8, min_per_thread=1 << 13)
    high = native.ptr(data, low_bytes)
    marks = native.run_jobs([("liq_popcount", (high + b0, b1 - b0)) for b0, b1 in parts])
    if sum(marks) != k:
        raise ValueError(f"corrupt top-k index block: {sum(marks)} index marks, expected k={k}")
    first = [0, *itertools.accumulate(marks)]
    idx = take(scratch, "ef.idx", k, torch.int64)
    got = native.run_jobs([("liq_ef_decode_part", (native.ptr(data), n, k, low, low_bytes, b0, b1, first[r],
                                                   native.ptr(idx)))
                           for r, (b0, b1) in enumerate(parts)])
    joins = [first[r] for r in range(1, len(parts)) if 0 < first[r] < k]
    increasing = not joins or bool((idx[joins] > idx[[j - 1 for j in joins]]).all())
    if got != marks or not increasing:
        raise ValueError(f"corrupt top-k index block: indices not strictly increasing below n={n}")
    return idx
