"""Fused Triton kernels for the blockwise codecs (fp8, int8, int4, int2) on CUDA.

The torch reference path of a blockwise codec makes about ten passes over memory (absmax, scale,
reciprocal, multiply, round, cast, pack); these kernels make three: one reads the vector and
writes the block scales, one reads it again and writes the packed values, and decoding reads the
packed values and writes the vector once. They produce the same bytes as the reference path,
because every operation is one of the codec's exact or correctly rounded IEEE fp32 steps (see the
docstring of :mod:`lightning_islands.codecs.wire`):

- ``scale = div_rn(absmax, qmax)`` and ``inv = min(div_rn(1, scale), FLT_MAX)``: correctly rounded
  divisions (Triton's ``/`` on fp32 is an approximate division);
- ``t = x * inv``, then round half to even by adding and subtracting 1.5 * 2**23 (exact for
  |t| < 2**22) with FMA contraction switched off (``enable_fp_fusion=False``): a fused
  ``x * inv + 1.5 * 2**23`` would round the exact product instead of ``fl(x * inv)``;
- fp8 codes are made from the fp32 bits by integer arithmetic, not by a hardware conversion, which
  older GPUs lack and whose rounding mode Triton chooses;
- decoding is ``value * scale``, the one rounding, after an exact int-to-float conversion.

The same kernel source runs on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``), which
is how the tests check the kernels against the reference bytes on a machine without a GPU. On a
GPU, :mod:`lightning_islands.codecs` additionally compares them with the reference path once per
device and codec before trusting them (a compiler that rounds differently must not change the wire
format).

Importing this module needs ``triton``; :mod:`lightning_islands.codecs` imports it only for CUDA
tensors and falls back to the torch path without it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["decode_blockwise", "encode_blockwise", "interpreted", "kernels", "offset", "one_pass_unit", "scale_tiling"]

# Globals used inside kernels must be constexpr (compiled Triton refuses other globals).
_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_ROUND = tl.constexpr(12582912.0)  # 1.5 * 2**23: (t + _ROUND) - _ROUND rounds half to even for |t| < 2**22
_SCALE_TILE = 2048  # elements per program of the scales kernel
_UNIT_TARGET = 4096  # values per program of the one-pass encoder, at least
_MAX_UNIT = 16384  # larger blocks take the two-pass encoder (a program holds a whole unit)


def _block_scales(x_ptr, scale_ptr, inv_ptr, count, nblocks, qmax,  # noqa: ANN001, ANN202
                  BLOCK: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr):
    """Per block: scale = absmax / qmax (NaN if the block holds a NaN), inv = min(1 / scale, FLT_MAX)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, CHUNK)
    amax = tl.zeros([ROWS], dtype=tl.float32)
    nans = tl.zeros([ROWS], dtype=tl.float32)  # NaN if the block holds one, else +0.0
    for c0 in range(0, BLOCK, CHUNK):
        col = c0 + cols
        pos = rows[:, None] * BLOCK + col[None, :]
        mask = (col[None, :] < BLOCK) & (pos < count)
        x = tl.load(x_ptr + pos, mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))  # a max may drop NaNs: they go to nans
        nans += tl.sum(tl.where(x != x, x, 0.0), axis=1)
    scale = tl.math.div_rn(amax, tl.full([ROWS], qmax, tl.float32)) + nans  # + 0.0 is exact (scale >= +0)
    inv = tl.minimum(tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), scale), _FLT_MAX)
    ok = rows < nblocks
    tl.store(scale_ptr + rows, scale, mask=ok)
    tl.store(inv_ptr + rows, inv, mask=ok)


@triton.jit
def _group_layout(count, BITS: tl.constexpr, GROUP: tl.constexpr):  # noqa: ANN001, ANN202
    """This program's packing group as a [values per byte, bytes] tile: the group index, the bit
    field index ``i`` of each row, the group's byte count (the last group may be short), each
    entry's position in the vector, and which entries are real values (the rest is the last
    group's zero padding)."""
    PACK: tl.constexpr = 8 // BITS
    g = tl.program_id(0).to(tl.int64)
    start = g * GROUP
    size = tl.minimum(count - start, GROUP)
    width = (size + PACK - 1) // PACK
    i = tl.arange(0, PACK)[:, None]
    j = tl.arange(0, GROUP // PACK)[None, :]
    pos = start + i * width + j
    return g, i, width, pos, (j < width) & (pos < start + size)


@triton.jit
def _codes(t, i, BITS: tl.constexpr, OFFSET: tl.constexpr, FP8: tl.constexpr):  # noqa: ANN001, ANN202
    """The codes of scaled values ``t`` (``x * inv``), each in its bit field ``i`` of a packed byte."""
    if FP8:
        u = t.to(tl.uint32, bitcast=True)
        a = u & 0x7FFFFFFF
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960  # mantissa to 3 bits, exponent 127 -> 7
        tiny = (a.to(tl.float32, bitcast=True) * 512.0 + _ROUND) - _ROUND  # multiples of 2**-9
        code = tl.where(a >= 0x3C800000, normal, tiny.to(tl.uint32) & 0x7F) | ((u >> 24) & 0x80)
    else:
        q = ((t + _ROUND) - _ROUND).to(tl.int32)
        if BITS == 8:
            code = q & 0xFF
        else:
            code = (q + OFFSET) << (i * BITS)  # offset binary, bit field i
    return code


def _encode_group(x_ptr, inv_ptr, out_ptr, count,  # noqa: ANN001, ANN202
                  BLOCK: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr, FP8: tl.constexpr,
                  GROUP: tl.constexpr):
    """One packing group: quantize with the block multipliers and pack group-planar (codecs/wire.py)."""
    PER: tl.constexpr = GROUP // (8 // BITS)
    g, i, width, pos, valid = _group_layout(count, BITS, GROUP)
    x = tl.load(x_ptr + pos, mask=valid, other=0.0)
    r = tl.load(inv_ptr + pos // BLOCK, mask=valid, other=0.0)
    byte = tl.sum(_codes(x * r, i, BITS, OFFSET, FP8), axis=0)  # disjoint bit fields: the sum is their OR
    jj = tl.arange(0, PER)
    tl.store(out_ptr + g * PER + jj, byte.to(tl.uint8), mask=jj < width)


def _encode_units(x_ptr, scale_ptr, out_ptr, qmax,  # noqa: ANN001, ANN202
                  BLOCK: tl.constexpr, UNIT: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr,
                  FP8: tl.constexpr, GROUP: tl.constexpr):
    """One pass over one whole unit of ``UNIT`` values (whole blocks and whole packing groups, powers
    of two): the block scales, then the values quantized with them and packed, from one read of
    the input. The same operations as :func:`_block_scales` and :func:`_encode_group`, so the same
    bytes; only whole units (a partial last group has another layout)."""
    PACK: tl.constexpr = 8 // BITS
    NB: tl.constexpr = UNIT // BLOCK
    u = tl.program_id(0).to(tl.int64)
    x = tl.reshape(tl.load(x_ptr + u * UNIT + tl.arange(0, UNIT)), [NB, BLOCK])
    amax = tl.max(tl.abs(x), axis=1)  # a max may drop NaNs: they go to nans
    nans = tl.sum(tl.where(x != x, x, 0.0), axis=1)  # NaN if the block holds one, else +0.0
    scale = tl.math.div_rn(amax, tl.full([NB], qmax, tl.float32)) + nans
    inv = tl.minimum(tl.math.div_rn(tl.full([NB], 1.0, tl.float32), scale), _FLT_MAX)
    tl.store(scale_ptr + u * NB + tl.arange(0, NB), scale)
    # the unit as packing groups [groups, bit field i, byte j]: value i * (GROUP // PACK) + j of a
    # group goes to bit field i of its byte j (group-planar, codecs/wire.py)
    t = tl.reshape(x * inv[:, None], [UNIT // GROUP, PACK, GROUP // PACK])
    i = tl.arange(0, PACK)[None, :, None]
    byte = tl.sum(_codes(t, i, BITS, OFFSET, FP8), axis=1)  # disjoint bit fields: the sum is their OR
    tl.store(out_ptr + u * (UNIT // PACK) + tl.arange(0, UNIT // PACK), tl.reshape(byte, [UNIT // PACK]).to(tl.uint8))


def _decode_group(val_ptr, scale_ptr, out_ptr, count,  # noqa: ANN001, ANN202
                  BLOCK: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr, FP8: tl.constexpr,
                  GROUP: tl.constexpr):
    """One packing group: unpack, convert exactly to fp32, multiply by the block scale."""
    PER: tl.constexpr = GROUP // (8 // BITS)
    g, i, width, pos, valid = _group_layout(count, BITS, GROUP)
    j = tl.arange(0, PER)[None, :]
    b = tl.load(val_ptr + g * PER + j, mask=j < width, other=0)
    if FP8:
        c = b.to(tl.uint32)
        em = c & 0x7F
        normal = (em << 20) + (120 << 23)  # exponent 7 -> 127
        tiny = (em.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)  # mantissa * 2**-9, exact
        v = (tl.where(em >= 8, normal, tiny) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)
    elif BITS == 8:
        v = b.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        code = (b.to(tl.int32) >> (i * BITS)) & ((1 << BITS) - 1)
        v = (code - OFFSET).to(tl.float32)
    s = tl.load(scale_ptr + pos // BLOCK, mask=valid, other=0.0)
    tl.store(out_ptr + pos, v * s, mask=valid)


_SOURCES = {"scales": _block_scales, "encode": _encode_group, "units": _encode_units,
            "decode": _decode_group}


@functools.cache
def kernels() -> SimpleNamespace:
    """The kernels as Triton functions: compiled for CUDA tensors, or, when ``TRITON_INTERPRET=1`` was
    set before triton was imported, run by Triton's interpreter on CPU tensors (slow; for checking
    the kernel source without a GPU)."""
    return SimpleNamespace(**{name: triton.jit(fn) for name, fn in _SOURCES.items()})


def interpreted() -> bool:
    """Whether triton runs kernels in its interpreter (``TRITON_INTERPRET=1``) in this process."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older ones read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_OPTIONS = {"enable_fp_fusion": False}  # no FMA contraction: every rounding as written (every launch passes it)


def scale_tiling(block: int) -> tuple[int, int]:
    """``(ROWS, CHUNK)`` of the scales kernel for a block size: blocks per program, and elements of a
    block read per step (a power of two, at most 2048)."""
    chunk = min(1 << (block - 1).bit_length(), _SCALE_TILE)
    return max(1, _SCALE_TILE // chunk), chunk


def offset(bits: int) -> int:
    """The offset-binary bias of packed codes (``codecs/wire.py``): 8 for int4, 1 for int2, else 0."""
    return {4: 8, 2: 1}.get(bits, 0)


def one_pass_unit(block: int, group: int) -> int | None:
    """Values per program of the one-pass encoder for a block size: whole blocks and whole packing
    groups, at least :data:`_UNIT_TARGET`; None where the block is not a power of two or larger
    than :data:`_MAX_UNIT` (those blocks take the two-pass encoder). ``LI_TRITON_ONE_PASS=0``
    switches the one-pass encoder off (the benchmark compares the two)."""
    if os.environ.get("LI_TRITON_ONE_PASS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if block & (block - 1) or group & (group - 1) or block > _MAX_UNIT:
        return None
    return max(block, group, _UNIT_TARGET)


def encode_blockwise(x: Tensor, scales: Tensor, values: Tensor, block: int, bits: int, fp8: bool,
                     qmax: float, group: int) -> None:
    """Write the block scales (fp32) and the packed values (uint8) of the flat fp32 ``x``.

    ``bits`` is 8, 4 or 2 (8 for fp8); ``group`` is the planar packing group (``codecs.PACK_GROUP``).
    A block holding a NaN gets a NaN scale (and an Inf an Inf scale), which the caller rejects.
    Whole units of :func:`one_pass_unit` values are encoded in one pass over ``x``; the rest (a
    partial last unit, or every value where the block size has no unit) reads ``x`` twice, once
    for the scales and once for the values. Both give the same bytes.
    """
    count = x.numel()
    if count == 0:
        return
    k = kernels()
    unit = one_pass_unit(block, group)
    done = count // unit * unit if unit else 0
    with _on_device(x):
        if done:
            k.units[(done // unit,)](x, scales, values, float(qmax), BLOCK=block, UNIT=unit, BITS=bits,
                                     OFFSET=offset(bits), FP8=fp8, GROUP=group, **_OPTIONS)
        if done < count:
            _encode_two_pass(k, x[done:], scales[done // block :], values[done // (8 // bits) :], block, bits, fp8,
                             qmax, group)


def _encode_two_pass(k: SimpleNamespace, x: Tensor, scales: Tensor, values: Tensor, block: int, bits: int,
                     fp8: bool, qmax: float, group: int) -> None:
    """The scales kernel, then the packing kernel: any block size, any length."""
    count = x.numel()
    nblocks = -(-count // block)
    inv = torch.empty(nblocks, dtype=torch.float32, device=x.device)
    rows, chunk = scale_tiling(block)
    k.scales[(math.ceil(nblocks / rows),)](x, scales, inv, count, nblocks, float(qmax),
                                           BLOCK=block, ROWS=rows, CHUNK=chunk, **_OPTIONS)
    k.encode[(math.ceil(count / group),)](x, inv, values, count, BLOCK=block, BITS=bits, OFFSET=offset(bits),
                                          FP8=fp8, GROUP=group, **_OPTIONS)


def decode_blockwise(values: Tensor, scales: Tensor, out: Tensor, block: int, bits: int, fp8: bool,
                     group: int) -> None:
    """Inverse of :func:`encode_blockwise`: ``out[i] = value_i * scale[i // block]``."""
    count = out.numel()
    if count == 0:
        return
    with _on_device(out):
        kernels().decode[(math.ceil(count / group),)](values, scales, out, count, BLOCK=block, BITS=bits,
                                                      OFFSET=offset(bits), FP8=fp8, GROUP=group, **_OPTIONS)


def _on_device(t: Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device and stream: make them ``t``'s."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()

