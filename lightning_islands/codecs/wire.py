"""The wire format every island writes and reads: header, body layouts, codec ids.

Payload = 32-byte header + body, all little-endian.

Header (``struct`` format ``<4sHBBIQQI``)::

    0  magic     b"LIQ1"
    4  version   u16   FORMAT_VERSION
    6  codec id  u8    1 fp32, 2 bf16, 3 fp8, 4 int8, 5 int4, 6 int2, 7 sign (the inner codec for top-k)
    7  kind      u8    0 dense, 1 top-k with Elias-Fano indices
    8  block     u32   block size (0 for fp32/bf16, which have none)
    12 n         u64   element count of the original vector
    20 k         u64   number of values carried (n for dense codecs)
    28 crc32     u32   zlib.crc32 of header bytes [0, 28) followed by the whole body

The checksum deliberately also covers the header fields (not only the body): a flipped bit in
``n`` could otherwise keep the payload length unchanged (int4 stores ceil(n/2) bytes) and decode
silently to the wrong length.

Body of a blockwise codec carrying m values (m = n, or m = k for top-k)::

    scales  ceil(m/B) x fp32 (one per block; the last block may be partial)
    values  int8/fp8: m bytes.  int4: ceil(m/2) bytes.  int2: ceil(m/4) bytes.  sign: ceil(m/8) bytes.

Packing is *group-planar*: the value stream is cut into groups of ``PACK_GROUP = 2048`` values
(independent of the block size; the last group has its length rounded up to a multiple of 2, 4
or 8 and is zero padded). For int4, byte j of a group of width W holds value j in its low nibble
and value j + W/2 in its high nibble; for int2, byte j holds values j, j+W/4, j+W/2, j+3W/4 in bits
0-1, 2-3, 4-5, 6-7; for sign, bit i of byte j is the sign bit of value j + i*W/8. Nibbles/crumbs
are offset binary (q + 8 for int4, q + 1 for int2); sign bits are 1 for negative (-0.0 included). Planar
(rather than adjacent-pair) packing keeps every packing op on long contiguous runs, so it
vectorizes on CPU and coalesces on GPU. Padding values are dropped on decode.

Top-k body: ``[inner body for the k kept values, in increasing index order][EF low bits]
[EF high bits]``. Indices are Elias-Fano coded, which is the fixed-size form of delta coding:
with ``l = floor(log2(n/k))`` the low ``l`` bits of each index are stored verbatim
(ceil(k*l/8) bytes) and the high parts as a unary-coded bit vector of
``k + ((n-1) >> l) + 1`` bits, i.e. about ``2 + log2(n/k)`` bits per index (8.6 bits at 1%
instead of 32 for int32 indices). Unlike varint deltas its size depends only on ``(n, k)``, so
:meth:`~lightning_islands.codecs.base.Codec.nbytes` stays an exact formula, and both directions
are vectorized (bit (un)packing with shifts, ``nonzero`` for the unary part).

Quantization rule: ``scale = fl(absmax/qmax)`` per block, ``r = fl(1/scale)`` (clamped to the
largest float, so all-zero and denormal-tiny blocks get a finite multiplier) and
``q = round_half_even(x * r)`` via ``torch.round`` for int codecs, ``float8_e4m3fn(x * r)`` (also
round to nearest even) for fp8. Since ``|x * r| <= qmax * (1 + 2**-22)`` no clamp is needed, and
``|x - q*scale| <= scale/2`` up to a few fp32 ulps of absmax. All-zero blocks get scale +0.0 and
decode to exact zeros. Decoding is ``q.float() * scale``: the int-to-float conversion is exact,
so the multiply is the only rounding. ``sign`` instead stores ``scale = fl32(sum|x| / len)`` of each
block, the sum taken in float64 over a fixed pairwise tree (so it is the same on every device),
and decodes to ``+scale`` or ``-scale``. Non-finite input raises :class:`ValueError` (a diverged
pseudo-gradient must not be shipped to the other islands).
"""

from __future__ import annotations

import struct

import torch
from torch import Tensor

FORMAT_VERSION = 1
MAGIC = b"LIQ1"
HEADER = struct.Struct("<4sHBBIQQI")
HEADER_BYTES = HEADER.size  # 32
CRC_OFFSET = 28

KIND_DENSE = 0
KIND_TOPK = 1
KIND_NAMES = {KIND_DENSE: "dense", KIND_TOPK: "top-k"}

BASE_CODECS = ("fp32", "bf16", "fp8", "int8", "int4", "int2", "sign")
CODEC_IDS = {name: i + 1 for i, name in enumerate(BASE_CODECS)}
CODEC_NAMES = {i: name for name, i in CODEC_IDS.items()}

DEFAULT_BLOCK_SIZE = 128
MAX_BLOCK_SIZE = 1 << 24
PACK_GROUP = 2048  # values per planar packing group of int4/int2 (part of the wire format)


def block_pieces(count: int, block: int) -> list[tuple[int, int, int, int]]:
    """``[0, count)`` as row-shaped pieces, ``(start, stop, rows, first block)``: the whole blocks,
    then the partial last block as one short row (no padding), so ``t[start:stop].view(rows, -1)``
    lines up with ``scales[first block : first block + rows]``."""
    full = count // block
    pieces = [(0, full * block, full, 0)] if full else []
    if count > full * block:
        pieces.append((full * block, count, 1, full))
    return pieces


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``, in integers."""
    return -(-a // b)


def header_bytes(payload: Tensor) -> bytes:
    """The 32 header bytes of a payload (copied to the host), after checking it is a long enough 1-D uint8 tensor."""
    if not isinstance(payload, Tensor):
        raise TypeError(f"payload must be a torch.Tensor, got {type(payload).__name__}")
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(f"payload must be a 1-D uint8 tensor, got {payload.dtype} shape {tuple(payload.shape)}")
    if payload.numel() < HEADER_BYTES:
        raise ValueError(f"payload truncated: {payload.numel()} bytes, shorter than the {HEADER_BYTES}-byte header")
    return bytes(payload[:HEADER_BYTES].cpu().numpy().tobytes())


def describe(codec_id: int, kind: int, block: int) -> str:
    """A codec as error messages name it, from the header fields, e.g. ``'int4/128'`` or ``'top-k + int2/128'``."""
    name = CODEC_NAMES.get(codec_id, f"unknown codec id {codec_id}")
    base = f"{name}/{block}" if block else name
    if kind == KIND_DENSE:
        return f"'{base}'"
    return f"'{KIND_NAMES.get(kind, f'unknown kind {kind}')} + {base}'"
