"""The CRC-32 of a GPU payload, taken on the GPU (Triton), so the payload is not copied to the host for it.

Every payload carries zlib's CRC-32 of its header and body (:mod:`lightning_islands.codecs`). For a
payload on a GPU that checksum used to be taken on the host after copying the whole body there: on
an H200 that took 0.72 s for the 1 GiB body of an fp32 payload, hundreds of times the codec
kernels' own time.

The raw CRC (no conditioning) is linear over GF(2) (:mod:`lightning_islands.codecs.crc32`), so it is
computed here as a tree of folds. The first level turns every 1024 bytes into their raw CRC; each
further level turns 256 raw CRCs into the raw CRC of their concatenation, until one is left. The
message is padded with zero bytes in front to whole groups, which leaves a raw CRC unchanged. A
fold multiplies each set bit by a precomputed weight (:func:`crc32.weight_table`) and xors the
products: integer operations only, exact on every GPU and in any order, so the result is zlib's
CRC bit for bit. The same kernel runs under Triton's interpreter on CPU tensors, which is how the
tests check it without a GPU; :mod:`lightning_islands.codecs` also compares it with zlib once per
device before using it.

Importing this module needs ``triton``.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_islands.codecs import crc32
from lightning_islands.codecs.triton_kernels import _on_device

__all__ = ["BYTE_GROUP", "RAW_GROUP", "raw_crc"]

BYTE_GROUP = 1024  # bytes folded into one raw CRC by the first level
RAW_GROUP = 256  # raw CRCs folded into one by each further level
_ROWS = 8  # groups per program


@triton.jit
def _fold(src_ptr, tab_ptr, out_ptr, n, pad, ngroups,  # noqa: ANN001, ANN202
          BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr):
    """``out[g]``: the raw CRC of group ``g``, the xor over its elements ``v[g * GROUP + i]`` of
    ``sum_b bit_b(v) * tab[b, i]``, where ``v[k] = src[k - pad]`` (zero outside the source)."""
    i = tl.arange(0, GROUP)
    b = tl.arange(0, BITS).to(tl.uint32)
    tab = tl.load(tab_ptr + b[:, None] * GROUP + i[None, :]).to(tl.uint32, bitcast=True)
    for r in range(ROWS):
        g = tl.program_id(0).to(tl.int64) * ROWS + r
        k = g * GROUP + i - pad
        v = tl.load(src_ptr + k, mask=(k >= 0) & (k < n), other=0)
        if BITS == 32:
            v = v.to(tl.uint32, bitcast=True)
        else:
            v = v.to(tl.uint32)
        bits = (v[None, :] >> b[:, None]) & 1
        folded = tl.xor_sum(tl.xor_sum(bits * tab, axis=0), axis=0)
        tl.store(out_ptr + g, folded.to(tl.int32, bitcast=True), mask=g < ngroups)


@functools.cache
def _table(bits: int, group: int, step: int, tail: int, device: torch.device) -> Tensor:
    """:func:`crc32.weight_table` as an int32 tensor ``[bits, group]`` on ``device``."""
    rows = np.array(crc32.weight_table(bits, group, step, tail), dtype=np.uint32)
    return torch.from_numpy(rows.view(np.int32)).to(device)


def raw_crc(body: Tensor, byte_group: int = BYTE_GROUP, raw_group: int = RAW_GROUP) -> int:
    """The raw CRC-32 (register from 0, no final xor) of a contiguous 1-D uint8 tensor, computed on
    its device; :func:`crc32.from_raw` turns it into zlib's ``crc32``. ``byte_group`` and
    ``raw_group`` (powers of two) are the fan-in of the first and of the further levels."""
    if body.dtype != torch.uint8 or body.dim() != 1 or not body.is_contiguous():
        raise ValueError(f"raw_crc takes a contiguous 1-D uint8 tensor, got {body.dtype} {tuple(body.shape)}")
    for fan_in in (byte_group, raw_group):
        if fan_in < 2 or fan_in & (fan_in - 1):
            raise ValueError(f"raw_crc's group sizes must be powers of two >= 2, got {byte_group}, {raw_group}")
    n = body.numel()
    if n == 0:
        return 0
    src, bits, group, step, tail = body, 8, byte_group, 1, 1
    with _on_device(body):
        while True:
            ngroups = math.ceil(n / group)
            out = torch.empty(ngroups, dtype=torch.int32, device=body.device)
            _fold[(math.ceil(ngroups / _ROWS),)](src, _table(bits, group, step, tail, body.device), out, n,
                                                ngroups * group - n, ngroups, BITS=bits, GROUP=group, ROWS=_ROWS)
            if ngroups == 1:
                return int(out.item()) & 0xFFFFFFFF
            # each raw CRC of the next level's input stands for ``group * step`` bytes of the message
            src, n, step = out, ngroups, group * step
            bits, group, tail = 32, raw_group, 0
