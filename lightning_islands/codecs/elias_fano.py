"""Elias-Fano coding of the strictly increasing indices a top-k payload carries.

Its size depends only on ``(n, k)`` (see :mod:`lightning_islands.codecs.wire`), so a payload's
length stays an exact formula.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_islands.codecs.wire import ceil_div


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
    if low:
        shifts = torch.arange(low, dtype=torch.int64, device=idx.device)
        bits = ((idx.unsqueeze(1) >> shifts) & 1).to(torch.uint8).view(-1)
        out[:low_bytes].copy_(_pack_bits(bits, low_bytes))
    positions = (idx >> low) + torch.arange(k, dtype=torch.int64, device=idx.device)
    unary = torch.zeros(high_bytes * 8, dtype=torch.uint8, device=idx.device)
    unary[positions] = 1
    out[low_bytes:].copy_(_pack_bits(unary, high_bytes))


def ef_decode(data: Tensor, n: int, k: int) -> Tensor:
    """The k int64 indices below n that :func:`ef_encode` wrote into ``data``; ValueError naming the
    fault if the block does not hold k strictly increasing indices below n."""
    low, low_bytes, high_bytes = ef_layout(n, k)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device)
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

