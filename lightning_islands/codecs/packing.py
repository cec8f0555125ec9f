"""Group-planar packing of 4-, 2- and 1-bit values, two, four or eight to a byte (torch path).

The layout is part of the wire format (see :mod:`lightning_islands.codecs.wire`); the Triton
kernels write the same bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_islands.codecs.wire import PACK_GROUP, ceil_div


def pack_planar(q: Tensor, out: Tensor, pack: int) -> None:
    """Pack two's-complement int values (a uint8 view) ``pack`` per byte into ``out``.

    Group-planar layout: within each group of ``PACK_GROUP`` values (the last group: its length
    rounded up to a multiple of ``pack``, zero padded), byte j holds values j + i*W/pack for
    i = 0..pack-1 in bit field i, offset binary. uint8 arithmetic wraps mod 256, so
    ``sum_i (q_i + offset) << (bits*i)`` is computed as ``sum_i q_i * 2**(bits*i) + const``.
    """
    count = q.numel()
    per = PACK_GROUP // pack
    full = count // PACK_GROUP
    if full:
        _pack_rows(q[: full * PACK_GROUP].view(full, pack, per), out[: full * per].view(full, per), pack)
    rem = count - full * PACK_GROUP
    if rem:
        width = ceil_div(rem, pack) * pack
        tail = q[full * PACK_GROUP :]
        if width != rem:
            tail = torch.cat([tail, tail.new_zeros(width - rem)])
        _pack_rows(tail.view(1, pack, width // pack), out[full * per :].view(1, width // pack), pack)


def _pack_rows(qv: Tensor, out: Tensor, pack: int) -> None:
    if pack == 8:  # sign bits, as they are
        torch.add(qv[:, 0], qv[:, 1], alpha=2, out=out)
        for i in range(2, 8):
            out.add_(qv[:, i], alpha=1 << i)
    elif pack == 2:  # nibbles q + 8
        torch.add(qv[:, 0], qv[:, 1], alpha=16, out=out)
        out.add_(0x88)
    else:  # crumbs q + 1
        torch.add(qv[:, 0], qv[:, 1], alpha=4, out=out)
        out.add_(qv[:, 2], alpha=16)
        out.add_(qv[:, 3], alpha=64)
        out.add_(0x55)


def unpack_planar(packed: Tensor, q: Tensor, pack: int) -> None:
    """Inverse of :func:`pack_planar`: fill ``q`` (uint8, the value count) with two's-complement ints."""
    count = q.numel()
    per = PACK_GROUP // pack
    full = count // PACK_GROUP
    if full:
        _unpack_rows(packed[: full * per].view(full, per), q[: full * PACK_GROUP].view(full, pack, per), pack)
    rem = count - full * PACK_GROUP
    if rem:
        width = ceil_div(rem, pack) * pack
        dst = q[full * PACK_GROUP :] if width == rem else q.new_empty(width)
        _unpack_rows(packed[full * per :].view(1, width // pack), dst.view(1, pack, width // pack), pack)
        if width != rem:
            q[full * PACK_GROUP :].copy_(dst[:rem])
    if pack != 8:  # sign bits stay 0 / 1
        q.sub_(8 if pack == 2 else 1)  # offset binary -> two's complement (wraps mod 256)


def _unpack_rows(packed: Tensor, qv: Tensor, pack: int) -> None:
    if pack == 8:
        torch.bitwise_and(packed, 1, out=qv[:, 0])
        for i in range(1, 7):
            torch.bitwise_right_shift(packed, i, out=qv[:, i]).bitwise_and_(1)
        torch.bitwise_right_shift(packed, 7, out=qv[:, 7])
    elif pack == 2:
        torch.bitwise_and(packed, 0x0F, out=qv[:, 0])
        torch.bitwise_right_shift(packed, 4, out=qv[:, 1])
    else:
        torch.bitwise_and(packed, 0x03, out=qv[:, 0])
        torch.bitwise_right_shift(packed, 2, out=qv[:, 1]).bitwise_and_(0x03)
        torch.bitwise_right_shift(packed, 4, out=qv[:, 2]).bitwise_and_(0x03)
        torch.bitwise_right_shift(packed, 6, out=qv[:, 3])
