"""Pseudo-gradient codecs: quantize once, ship bytes, dequantize bit-identically everywhere.

Every ``H`` inner steps each island turns its flat fp32 pseudo-gradient into a byte payload with
:meth:`Codec.encode`; the islands exchange payloads, and every island runs :meth:`Codec.decode` on
all of them and sums in island order. Decoding is a pure function of the payload bytes made of
exact operations plus one correctly rounded fp32 multiply per element (``q.float() * scale``),
so every island, on CPU or GPU, reconstructs bit-identical tensors and hence the same merge.

Codecs are selected by a spec string (see :func:`make_codec`)::

    fp32                raw float32 (exact)
    bf16                bfloat16, round-to-nearest-even (relative error <= 2**-8)
    fp8                 float8_e4m3fn values, one fp32 scale = absmax/448 per block
    int8 | int4 | int2  symmetric blockwise absmax quantization, q in [-qmax, qmax],
                        qmax = 127 | 7 | 1, scale = absmax/qmax (fp32) per block
    sign                one bit per value (its sign), scale = mean |x| (fp32) per block
    topk:F              keep the ceil(F*n) largest-magnitude entries, values as fp32
    topk:F+int4         ... values quantized by the inner codec (any of the above)
    <codec>/B           block size B (default 128, a positive multiple of 4), e.g. "int4/64"

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
[EF high bits]``. Indices are Elias-Fano coded, which is the fixed-size form of delta coding: with
``l = floor(log2(n/k))`` the low ``l`` bits of each index are stored verbatim (ceil(k*l/8) bytes)
and the high parts as a unary-coded bit vector of ``k + ((n-1) >> l) + 1`` bits, i.e. about
``2 + log2(n/k)`` bits per index (8.6 bits at 1% instead of 32 for int32 indices). Unlike varint
deltas its size depends only on ``(n, k)``, so :meth:`Codec.nbytes` stays an exact formula, and
both directions are vectorized (bit (un)packing with shifts, ``nonzero`` for the unary part).

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

CPU work is cache-blocked: the blockwise codecs process slabs of about 2**20 elements (a Python
loop over ~4 MiB slabs, never over blocks or elements) so their fp32 temporaries stay in cache
instead of streaming through DRAM; on other devices the whole vector is one slab.

Fast paths, same bytes: on CPU the C kernels of :mod:`lightning_islands.native`; on CUDA the Triton
kernels of :mod:`lightning_islands.triton_kernels` for the blockwise codecs, each checked against
the torch path on a probe vector before its first use on a device (:meth:`_BlockCodec._triton`).
``native.disabled()`` turns both off in its thread; ``LI_TRITON=0`` turns the Triton ones off.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import os
import struct
import warnings
import zlib
from collections.abc import Callable
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_islands import codec_probe, crc32, native
from lightning_islands.crc32 import crc32_combine

try:  # same CRC-32 as zlib, ~10x faster (PCLMUL); optional
    from zlib_ng import zlib_ng as _zlib_fast
except ImportError:  # pragma: no cover - depends on the environment
    _zlib_fast = None
_CRC32 = _zlib_fast.crc32 if _zlib_fast is not None else zlib.crc32  # zlib's CRC-32 (a running value, bytes)

__all__ = [
    "BASE_CODECS",
    "DEFAULT_BLOCK_SIZE",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAGIC",
    "PACK_GROUP",
    "BFloat16Codec",
    "Codec",
    "ErrorFeedback",
    "Float8Codec",
    "Float32Codec",
    "IntCodec",
    "SignCodec",
    "TopKCodec",
    "compression_ratio",
    "crc32_combine",
    "default_error_feedback",
    "make_codec",
    "quantization_error",
]

FORMAT_VERSION = 1
MAGIC = b"LIQ1"
_HEADER = struct.Struct("<4sHBBIQQI")
HEADER_BYTES = _HEADER.size  # 32
_CRC_OFFSET = 28

_KIND_DENSE = 0
_KIND_TOPK = 1
_KIND_NAMES = {_KIND_DENSE: "dense", _KIND_TOPK: "top-k"}

BASE_CODECS = ("fp32", "bf16", "fp8", "int8", "int4", "int2", "sign")
_CODEC_IDS = {name: i + 1 for i, name in enumerate(BASE_CODECS)}
_CODEC_NAMES = {i: name for name, i in _CODEC_IDS.items()}

DEFAULT_BLOCK_SIZE = 128
_MAX_BLOCK_SIZE = 1 << 24
_CPU_SLAB_ELEMS = 1 << 20  # elements per cache-blocked slab on CPU (4 MiB of fp32, L3-resident)
_TOPK_SAMPLE = 1 << 15  # sample size for the top-k threshold estimate (torch path)
_TOPK_SAMPLE_RUN = 128  # the fused top-k samples runs of this many consecutive entries
_TOPK_BUCKET_SHIFT = 20  # the fused top-k's histogram buckets are |x| bits >> 20 ...
_TOPK_BUCKETS = 2048  # ... of which there are 2048
_INF_BITS = 0x7F800000
_TOPK_SLACK = 16  # liq_topk_pick stores whole 16-entry blocks and needs this many spare slots
PACK_GROUP = 2048  # values per planar packing group of int4/int2 (part of the wire format)
_FP32_MAX = torch.finfo(torch.float32).max
_BF16_MAX = torch.finfo(torch.bfloat16).max
_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_FP8_BITS_MASK = 0x87F00000 - (1 << 32)  # fp32 bit 31 and bits 20..26, as a signed int32

# ----------------------------------------------------------------------------------------------
# CRC32 (zlib polynomial) over large buffers: zlib.crc32 on pieces in threads, combined exactly.
# ----------------------------------------------------------------------------------------------

_CRC_PARALLEL_MIN_BYTES = 4 << 20
_CRC_PIECE_MIN_BYTES = 1 << 20
_CRC_WORKERS = min(8, os.cpu_count() or 1)


def _crc32(prefix: bytes, body: Tensor) -> int:
    """``zlib.crc32(prefix + body)`` for a uint8 tensor on any device, parallel for big bodies.

    zlib(-ng).crc32 releases the GIL on large buffers, so pieces run concurrently on
    :func:`native.thread_pool`; the per-piece CRCs are merged with :func:`crc32_combine` into
    exactly the CRC of the concatenation.
    """
    crc = zlib.crc32(prefix)
    if body.numel() == 0:
        return crc
    raw = _device_raw_crc(body)
    if raw is not None:  # taken on the GPU: the body stays there
        return crc32.from_raw(crc, raw, body.numel())
    data = (body if body.device.type == "cpu" else body.cpu()).numpy()
    size = data.shape[0]
    pool = native.thread_pool() if size >= _CRC_PARALLEL_MIN_BYTES and _CRC_WORKERS >= 2 else None
    if pool is None:
        return _CRC32(data, crc)
    piece = max(_CRC_PIECE_MIN_BYTES, -(-size // _CRC_WORKERS))
    bounds = [(s, min(s + piece, size)) for s in range(0, size, piece)]
    futures = [pool.submit(_CRC32, data[s:e]) for s, e in bounds[1:]]
    first = _CRC32(data[bounds[0][0] : bounds[0][1]], crc)
    return crc32.join([(first, 0)] + [(fut.result(), e - s) for (s, e), fut in zip(bounds[1:], futures)])


_GPU_CRC_MIN_BYTES = 256 << 10  # below this, copying the body to the host costs less than the kernel launches
_CRC_PROBE_BYTES = (1 << 20) + 777  # three fold levels of lightning_islands.triton_crc, the last ones partial
_CRC_KERNEL_TRUSTED: dict[str, bool] = {}  # device -> the GPU CRC-32 kernel agreed with zlib there


def _device_raw_crc(body: Tensor) -> int | None:
    """The raw CRC-32 of a CUDA body taken on its GPU (:mod:`lightning_islands.triton_crc`); None
    for small or CPU bodies, without triton, with ``LI_TRITON=0`` or :func:`native.disabled`, or
    where the kernel failed its check against zlib on this device."""
    if body.device.type != "cuda" or body.numel() < _GPU_CRC_MIN_BYTES:
        return None
    if not native.enabled() or _triton_mode() == "0" or _import_triton_kernels() is None:
        return None
    from lightning_islands import triton_crc

    return triton_crc.raw_crc(body) if _crc_kernel_trusted(triton_crc, body.device) else None


def _crc_kernel_trusted(module: Any, device: torch.device) -> bool:
    """Whether ``module.raw_crc`` gives zlib's CRC-32 on ``device``, checked once per device on a
    fixed random probe; a kernel that disagrees (or fails) is not used there, with a warning."""
    key = str(device)
    if key not in _CRC_KERNEL_TRUSTED:
        g = torch.Generator().manual_seed(0x11C)
        probe = torch.randint(0, 256, (_CRC_PROBE_BYTES,), dtype=torch.uint8, generator=g)
        want = zlib.crc32(probe.numpy().tobytes())
        try:
            got = crc32.from_raw(0, module.raw_crc(probe.to(device)), probe.numel())
            problem = None if got == want else f"CRC-32 {got:#010x} where zlib gives {want:#010x}"
        except Exception as e:  # noqa: BLE001 - a kernel that does not compile here is a reason to fall back
            problem = f"{type(e).__name__}: {e}"
        _CRC_KERNEL_TRUSTED[key] = problem is None
        if problem is not None:
            warnings.warn(f"lightning_islands: the GPU CRC-32 kernel on {device} failed its check ({problem}); "
                          "payload checksums there are taken on the host (slower, same value)", stacklevel=2)
    return _CRC_KERNEL_TRUSTED[key]


def _payload_crc(prefix: bytes, body: Tensor, body_crc: int | None) -> int:
    """CRC-32 of ``prefix + body``, from ``body_crc`` (the body's own CRC-32) where a fused kernel
    already took it, else by reading the body."""
    if body_crc is None:
        return _crc32(prefix, body)
    return crc32_combine(zlib.crc32(prefix), body_crc, body.numel())


def _crc_piece(t: Tensor) -> tuple[int, int]:
    """``(crc32, nbytes)`` of the bytes of a contiguous CPU tensor (zlib conditioning, no prefix):
    for a small piece of a body whose bulk a fused kernel checksummed (see :func:`_run_checksummed`)."""
    data = t.view(torch.uint8).numpy()
    return _CRC32(data), data.shape[0]


def _run_checksummed(count: int, unit: int, call: Callable[[int, int, int], int],
                     parts: Callable[[int, int], tuple[Tensor, ...]]) -> tuple[list[int], int]:
    """Run a fused kernel over ``[0, count)`` on the kernel threads, checksumming the body as it goes.

    Each thread takes one unit-aligned range ``[start, stop)`` and calls ``call(start, stop, crc)``,
    where ``crc`` is the address of one running CRC-32 (uint32, starting at 0) per body part
    (``parts(start, stop)`` are the range's pieces of each part, say its scales and its values).
    The kernel advances each over its piece of that part while the bytes are in cache: right after
    writing them (encode) or right before reading them (decode). Returns the kernel statuses and
    the CRC-32 of the body, i.e. of part 0 over all ranges in order, then part 1, and so on; or
    None for the CRC where the kernels have no fast CRC-32 (:func:`native.kernel_checksums`): they
    then get a null address and the caller checksums the body with zlib(-ng).
    """
    ranges = native.split(count, unit)
    if not native.kernel_checksums():
        return native.run_each(range(len(ranges)), lambda i: call(*ranges[i], 0)), None
    nparts = len(parts(0, 0))
    crcs = (ctypes.c_uint32 * max(1, len(ranges) * nparts))()

    def run(i: int, crcs: ctypes.Array = crcs) -> int:  # holds crcs while a kernel may write to it
        return call(*ranges[i], ctypes.addressof(crcs) + 4 * nparts * i)

    statuses = native.run_each(range(len(ranges)), run)
    sizes = [[t.numel() * t.element_size() for t in parts(s, e)] for s, e in ranges]
    crc = crc32.join([(crcs[i * nparts + p], sizes[i][p]) for p in range(nparts) for i in range(len(ranges))])
    return statuses, crc


# ----------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------


def _kernels(t: Tensor) -> Any:
    """The fused CPU kernels (a ctypes library) for a CPU tensor; None on other devices or without them."""
    return native.library() if t.device.type == "cpu" and _triton_mode() != "interpret" else None


def _triton_mode() -> str:
    """``LI_TRITON``: "1" (default) Triton kernels for CUDA tensors, "0" never, "interpret" also for
    CPU tensors under Triton's interpreter (needs ``TRITON_INTERPRET=1``; slow, for checking the
    GPU kernels on a machine without one)."""
    mode = os.environ.get("LI_TRITON", "1").strip().lower()
    if mode in ("0", "false", "no", "off"):
        return "0"
    return "interpret" if mode == "interpret" else "1"


@functools.cache
def _import_triton_kernels() -> Any:
    """:mod:`lightning_islands.triton_kernels`, or None (said once) if triton cannot be imported."""
    try:
        from lightning_islands import triton_kernels
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken triton install failing on import
        warnings.warn(f"lightning_islands: triton is not importable ({e}); the codecs use the slower torch "
                      "path on the GPU (pip install triton)", stacklevel=5)
        return None
    return triton_kernels


def _triton_module(t: Tensor) -> Any:
    """:mod:`lightning_islands.triton_kernels` if the blockwise codecs should run it on ``t``'s
    device, else None (the fused CPU kernels or the torch path)."""
    mode = _triton_mode()
    if not native.enabled() or mode == "0" or t.device.type != ("cpu" if mode == "interpret" else "cuda"):
        return None
    triton_kernels = _import_triton_kernels()
    if triton_kernels is None:
        return None
    if mode == "interpret" and not triton_kernels.interpreted():
        raise RuntimeError("LI_TRITON=interpret runs the codec kernels under Triton's interpreter, which needs "
                           "TRITON_INTERPRET=1 in the environment before Python starts; set it, or unset LI_TRITON")
    return triton_kernels


def _block_pieces(count: int, block: int) -> list[tuple[int, int, int, int]]:
    """``[0, count)`` as row-shaped pieces, ``(start, stop, rows, first block)``: the whole blocks,
    then the partial last block as one short row (no padding), so ``t[start:stop].view(rows, -1)``
    lines up with ``scales[first block : first block + rows]``."""
    full = count // block
    pieces = [(0, full * block, full, 0)] if full else []
    if count > full * block:
        pieces.append((full * block, count, 1, full))
    return pieces


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_input(x: Tensor) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"expected a float32 tensor, got {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"expected a 1-D (flat) tensor, got shape {tuple(x.shape)}")
    return x.contiguous()


def _nonfinite_error(x: Tensor) -> ValueError | None:
    """The error to raise if ``x`` holds NaN/Inf, else None (exact count, only on the slow path)."""
    bad = ~torch.isfinite(x)
    count = int(bad.sum())
    if count == 0:
        return None
    nans = int(torch.isnan(x).sum())
    return ValueError(
        f"pseudo-gradient has {count} non-finite values ({nans} NaN, {count - nans} +/-Inf) out of "
        f"{x.numel()}: the inner optimization diverged. Lower the learning rate (or clip "
        f"gradients) and resume from the last good checkpoint; refusing to ship it to other islands."
    )


def _raise_if_nonfinite_sum(x: Tensor) -> None:
    """One read pass: a finite sum proves every element finite; otherwise count exactly.

    (A non-finite sum of finite values, i.e. overflow, falls through the exact count harmlessly.)
    """
    if x.numel() and not math.isfinite(float(x.sum())):
        err = _nonfinite_error(x)
        if err is not None:
            raise err


def _fmt_fraction(f: Fraction) -> str:
    with localcontext() as ctx:
        ctx.prec = 60
        text = format((Decimal(f.numerator) / Decimal(f.denominator)).normalize(), "f")
    return text


# ----------------------------------------------------------------------------------------------
# base class
# ----------------------------------------------------------------------------------------------


class Codec:
    """A pseudo-gradient codec: flat fp32 tensor <-> uint8 payload (32-byte header + body).

    Subclasses implement the body format through ``_values_nbytes``, ``_encode_values`` and
    ``_decode_values``; the header, checksum and validation live here.
    """

    name: str = "codec"
    codec_id: int = 0
    kind: int = _KIND_DENSE
    block_size: int | None = None
    bits: float = 32.0  # nominal bits per transmitted value

    # -- body format hooks (per carried value count m) ------------------------------------------
    def _values_nbytes(self, m: int) -> int:
        raise NotImplementedError

    # The fused CPU paths also checksum the body while it is in cache and return its CRC-32 (no
    # prefix, zlib conditioning); other paths return None and the caller checksums separately.
    def _encode_values(self, v: Tensor, body: Tensor) -> int | None:
        raise NotImplementedError

    def _decode_values(self, body: Tensor, m: int, out: Tensor) -> int | None:
        raise NotImplementedError

    # -- overridable for sparse codecs ----------------------------------------------------------
    def _count(self, n: int) -> int:
        """Number of values carried for an input of n elements."""
        return n

    def _body_nbytes(self, n: int) -> int:
        return self._values_nbytes(n)

    def _encode_body(self, x: Tensor, body: Tensor) -> int | None:
        return self._encode_values(x, body)

    def _decode_body(self, body: Tensor, n: int, k: int, out: Tensor) -> int | None:
        return self._decode_values(body, n, out)

    def _checksums_while_decoding(self, body: Tensor) -> bool:
        """Whether ``_decode_body`` returns the body's CRC-32 (the fused CPU kernels do; the checksum
        is then verified after decoding instead of in a separate pass before it)."""
        return _kernels(body) is not None and native.kernel_checksums()

    # -- public API -----------------------------------------------------------------------------
    def nbytes(self, n: int) -> int:
        """Exact payload size in bytes (header included) for an input of ``n`` elements."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return HEADER_BYTES + self._body_nbytes(n)

    def spec(self) -> dict[str, Any]:
        """Everything that determines the wire format, for run fingerprints."""
        return {
            "codec": self.name,
            "family": _CODEC_NAMES.get(self.codec_id, "?"),
            "block_size": self.block_size,
            "k_fraction": None,
            "index_encoding": None,
            "format_version": FORMAT_VERSION,
        }

    def encode(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """Quantize a flat float32 tensor into a 1-D uint8 payload on the same device.

        ``out`` (optional): a contiguous uint8 tensor of exactly ``nbytes(x.numel())`` bytes on
        ``x``'s device to write the payload into (reusing a buffer avoids page-faulting fresh
        memory on every call). Raises ``ValueError`` if ``x`` contains NaN/Inf. Identical input
        gives identical bytes.
        """
        x = _check_input(x)
        n = x.numel()
        size = self.nbytes(n)
        if out is None:
            payload = torch.empty(size, dtype=torch.uint8, device=x.device)
        else:
            if (
                out.dtype != torch.uint8
                or out.dim() != 1
                or out.numel() != size
                or not out.is_contiguous()
                or out.device != x.device
                or out.storage_offset() % 4
            ):
                raise ValueError(
                    f"out must be a contiguous, 4-byte aligned 1-D uint8 tensor of {size} bytes on "
                    f"{x.device}, got {out.dtype} shape {tuple(out.shape)} on {out.device}"
                )
            payload = out
        body = payload[HEADER_BYTES:]
        body_crc = self._encode_body(x, body)
        header = _HEADER.pack(
            MAGIC, FORMAT_VERSION, self.codec_id, self.kind, self.block_size or 0, n, self._count(n), 0
        )[:_CRC_OFFSET]
        header += struct.pack("<I", _payload_crc(header, body, body_crc))
        payload[:HEADER_BYTES].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        return payload

    def decode(self, payload: Tensor, out: Tensor | None = None) -> Tensor:
        """Validate a payload and reconstruct the float32 tensor (same device as the payload).

        ``out`` (optional): a contiguous float32 tensor of the original length on the payload's
        device to decode into, avoiding a fresh allocation (large fresh CPU allocations cost
        page faults that can exceed the decode itself). Raises ``ValueError`` on any mismatch
        (wrong codec, truncation, corruption) with expected vs. got values. Where the fused CPU
        kernels checksum the body while decoding it, a corrupted payload is detected after ``out``
        was written: its contents are then unspecified (the error is raised all the same).
        """
        if isinstance(payload, Tensor) and (not payload.is_contiguous() or payload.storage_offset() % 4):
            payload = payload.clone(memory_format=torch.contiguous_format)  # fp32 views need alignment
        n, k, raw = self._validate_header(payload)
        body = payload[HEADER_BYTES:]
        late = self._checksums_while_decoding(body)
        if not late:  # check first: decoding a corrupted body could fail with a misleading error
            self._verify_crc(raw, _payload_crc(raw[:_CRC_OFFSET], body, None))
        if out is None:
            out = torch.empty(n, dtype=torch.float32, device=payload.device)
        elif (
            out.dtype != torch.float32
            or out.dim() != 1
            or out.numel() != n
            or not out.is_contiguous()
            or out.device != payload.device
        ):
            raise ValueError(
                f"out must be a contiguous 1-D float32 tensor of {n} elements on {payload.device}, got "
                f"{out.dtype} shape {tuple(out.shape)} on {out.device}"
            )
        body_crc = self._decode_body(body, n, k, out)
        if late:
            if body_crc is None:  # pragma: no cover - a codec that claims to checksum must do so
                raise RuntimeError(f"codec {self.name!r} did not checksum the body while decoding")
            self._verify_crc(raw, _payload_crc(raw[:_CRC_OFFSET], body, body_crc))
        return out

    def describe_header(self, payload: Tensor) -> dict[str, Any]:
        """Parse a payload header without validating it against this codec (for diagnostics)."""
        magic, version, codec_id, kind, block, n, k, crc = _HEADER.unpack(_header_bytes(payload))
        return {
            "magic": magic,
            "version": version,
            "codec": _describe(codec_id, kind, block),
            "block_size": block,
            "n": n,
            "k": k,
            "crc32": crc,
        }

    def _validate_header(self, payload: Tensor) -> tuple[int, int, bytes]:
        """Check everything but the checksum; ``(n, k, header bytes)``."""
        raw = _header_bytes(payload)
        magic, version, codec_id, kind, block, n, k, crc = _HEADER.unpack(raw)
        if magic != MAGIC:
            raise ValueError(f"not a lightning_islands codec payload: magic {magic!r}, expected {MAGIC!r}")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"payload format version {version}, but this build reads version {FORMAT_VERSION} "
                f"(islands running different lightning_islands versions?)"
            )
        mine = (self.codec_id, self.kind, self.block_size or 0)
        if (codec_id, kind, block) != mine:
            raise ValueError(
                f"codec mismatch: payload was encoded as {_describe(codec_id, kind, block)} but this "
                f"codec is {_describe(*mine)} ({self.name!r}); all islands must use the same codec spec"
            )
        expected_k = self._count(n)
        if k != expected_k:
            raise ValueError(
                f"payload carries k={k} values for n={n}, but codec {self.name!r} carries "
                f"k={expected_k} (different top-k fraction, or a corrupted header)"
            )
        expected_len = self.nbytes(n)
        got_len = payload.numel()
        if got_len != expected_len:
            what = "truncated" if got_len < expected_len else "has trailing bytes"
            raise ValueError(
                f"payload {what}: {got_len} bytes, expected {expected_len} for codec {self.name!r} and n={n}"
            )
        return n, k, raw

    @staticmethod
    def _verify_crc(raw: bytes, actual: int) -> None:
        """Raise if ``actual`` (the CRC-32 of header bytes [0, 28) + body) is not the header's."""
        (crc,) = struct.unpack_from("<I", raw, _CRC_OFFSET)
        if actual != crc:
            raise ValueError(
                f"payload checksum mismatch: header says crc32=0x{crc:08x}, header+body hash to "
                f"0x{actual:08x}; the payload was corrupted in transit"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


def _header_bytes(payload: Tensor) -> bytes:
    if not isinstance(payload, Tensor):
        raise TypeError(f"payload must be a torch.Tensor, got {type(payload).__name__}")
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(f"payload must be a 1-D uint8 tensor, got {payload.dtype} shape {tuple(payload.shape)}")
    if payload.numel() < HEADER_BYTES:
        raise ValueError(f"payload truncated: {payload.numel()} bytes, shorter than the {HEADER_BYTES}-byte header")
    return bytes(payload[:HEADER_BYTES].cpu().numpy().tobytes())


def _describe(codec_id: int, kind: int, block: int) -> str:
    name = _CODEC_NAMES.get(codec_id, f"unknown codec id {codec_id}")
    base = f"{name}/{block}" if block else name
    if kind == _KIND_DENSE:
        return f"'{base}'"
    return f"'{_KIND_NAMES.get(kind, f'unknown kind {kind}')} + {base}'"


# ----------------------------------------------------------------------------------------------
# element-wise codecs
# ----------------------------------------------------------------------------------------------


class Float32Codec(Codec):
    """Raw float32 values (exact round trip); the reference / no-compression codec."""

    name = "fp32"
    codec_id = _CODEC_IDS["fp32"]
    bits = 32.0

    def _values_nbytes(self, m: int) -> int:
        return 4 * m

    def _encode_values(self, v: Tensor, body: Tensor) -> int | None:
        dst = body.view(torch.float32)
        lib = _kernels(v)
        if lib is None:
            _raise_if_nonfinite_sum(v)
            dst.copy_(v)
            return None

        bad, crc = _run_checksummed(
            v.numel(), 16, lambda s, e, c: lib.liq_f32_copy_checked(native.ptr(v, s), e - s, native.ptr(dst, s), c),
            lambda s, e: (dst[s:e],))
        if any(bad):
            raise _nonfinite_error(v)  # type: ignore[misc]  # a bad flag means a non-finite value
        return crc

    def _decode_values(self, body: Tensor, m: int, out: Tensor) -> int | None:
        src = body.view(torch.float32)
        lib = _kernels(body)
        if lib is None:
            out.copy_(src)
            return None
        # the finiteness flag is ignored: what the payload holds is what it decodes to
        return _run_checksummed(
            m, 16, lambda s, e, c: lib.liq_f32_copy_checked(native.ptr(src, s), e - s, native.ptr(out, s), c),
            lambda s, e: (src[s:e],))[1]


class BFloat16Codec(Codec):
    """bfloat16 values (round to nearest even): relative error <= 2**-8, 2 bytes per value.

    Finite values beyond the bfloat16 range (|x| > ~3.39e38) are clamped to its largest value.
    """

    name = "bf16"
    codec_id = _CODEC_IDS["bf16"]
    bits = 16.0

    def _values_nbytes(self, m: int) -> int:
        return 2 * m

    def _encode_values(self, v: Tensor, body: Tensor) -> int | None:
        y = body.view(torch.bfloat16)
        lib = _kernels(v)
        if lib is not None:
            bad, crc = _run_checksummed(
                v.numel(), 16, lambda s, e, c: lib.liq_bf16_encode(native.ptr(v, s), e - s, native.ptr(y, s), c),
                lambda s, e: (y[s:e],))
            if any(bad):
                raise _nonfinite_error(v)  # type: ignore[misc]
            return crc
        y.copy_(v)
        # One pass over the half-size output catches both NaN/Inf input and overflow to Inf.
        # (A plain bf16 sum accumulates in fp32 internally and is ~50x faster than sum(dtype=fp32);
        # an overflowing sum of finite values just takes the exact path below.)
        if v.numel() and not math.isfinite(float(y.sum())):
            err = _nonfinite_error(v)
            if err is not None:
                raise err
            y.copy_(v.clamp(-_BF16_MAX, _BF16_MAX))
        return None

    def _decode_values(self, body: Tensor, m: int, out: Tensor) -> int | None:
        y = body.view(torch.bfloat16)
        lib = _kernels(body)
        if lib is None:
            out.copy_(y)
            return None

        return _run_checksummed(
            m, 16, lambda s, e, c: lib.liq_bf16_decode(native.ptr(y, s), e - s, native.ptr(out, s), c),
            lambda s, e: (y[s:e],))[1]


# ----------------------------------------------------------------------------------------------
# blockwise codecs
# ----------------------------------------------------------------------------------------------


class _Work:
    """Per-call scratch buffers, allocated lazily and reused across slabs."""

    def __init__(self, device: torch.device, elems: int) -> None:
        self.device = device
        self.elems = elems
        self._f32: Tensor | None = None
        self._u8: Tensor | None = None

    def f32(self, numel: int) -> Tensor:
        if self._f32 is None or self._f32.numel() < numel:
            self._f32 = torch.empty(max(numel, self.elems), dtype=torch.float32, device=self.device)
        return self._f32[:numel]

    def u8(self, numel: int) -> Tensor:
        if self._u8 is None or self._u8.numel() < numel:
            self._u8 = torch.empty(max(numel, self.elems), dtype=torch.uint8, device=self.device)
        return self._u8[:numel]


def _pack_planar(q: Tensor, out: Tensor, pack: int) -> None:
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
        width = _ceil_div(rem, pack) * pack
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


def _unpack_planar(packed: Tensor, q: Tensor, pack: int) -> None:
    """Inverse of :func:`_pack_planar`: fill ``q`` (uint8, the value count) with two's-complement ints."""
    count = q.numel()
    per = PACK_GROUP // pack
    full = count // PACK_GROUP
    if full:
        _unpack_rows(packed[: full * per].view(full, per), q[: full * PACK_GROUP].view(full, pack, per), pack)
    rem = count - full * PACK_GROUP
    if rem:
        width = _ceil_div(rem, pack) * pack
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


_TRITON_TRUSTED: dict[tuple[str, str], bool] = {}  # (device, codec name) -> Triton kernels agree there
_TRITON_MAX_BLOCK = 1 << 20  # larger blocks keep the torch path on GPUs (their probe would be too big)


class _BlockCodec(Codec):
    """Shared machinery: per-block fp32 absmax scales, cache-blocked slabs, partial last block."""

    pack = 1  # values per byte
    qmax = 1.0
    fp8 = False  # values are float8_e4m3fn codes (else two's complement / offset binary ints)

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
        if block_size <= 0 or block_size % 4 or block_size > _MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be a positive multiple of 4 and <= {_MAX_BLOCK_SIZE}, got {block_size}")
        self.block_size = block_size
        self.name = f"{_CODEC_NAMES[self.codec_id]}/{block_size}"

    def _values_nbytes(self, m: int) -> int:
        return 4 * _ceil_div(m, self.block_size) + _ceil_div(m, self.pack)

    def _checksums_while_decoding(self, body: Tensor) -> bool:
        return self._triton(body) is None and super()._checksums_while_decoding(body)

    def _slab_elems(self, device: torch.device, m: int) -> int:
        """Slab length: a multiple of the block size and (if packed) of the packing group."""
        unit = self.block_size if self.pack == 1 else math.lcm(self.block_size, PACK_GROUP)
        if device.type != "cpu":
            return max(unit, m)  # one slab: no cache blocking needed, fewer kernel launches
        return max(1, _CPU_SLAB_ELEMS // unit) * unit

    # per-slab kernels: x / out are flat slices of whole blocks (the last may be partial),
    # scale the matching fp32 scales, values the matching packed bytes
    def _encode_slab(self, x: Tensor, scale: Tensor, values: Tensor, work: _Work) -> None:
        raise NotImplementedError

    def _decode_slab(self, values: Tensor, scale: Tensor, out: Tensor, work: _Work) -> None:
        raise NotImplementedError

    def _scale_rows(self, x: Tensor, scale: Tensor, t: Tensor) -> None:
        """Per row of ``x``: scale = absmax/qmax; ``t = x * (1/scale)``."""
        amax = torch.amax(x, dim=1)
        amin = torch.amin(x, dim=1)
        # max(amax, -amin) is >= 0 but may be -0.0 (max(+0, -0) is unspecified); abs_ makes it +0.0.
        # NaN propagates through all three (checked after the slab loop).
        absmax = torch.maximum(amax, amin.neg_(), out=amax).abs_()
        # Divide by a tensor on x's device, not by a Python number: CUDA turns division by a host
        # scalar into a multiplication by its reciprocal (one bit off now and then), CPU does not.
        torch.div(absmax, absmax.new_full((), self.qmax), out=scale)
        # 1/scale, clamped so that all-zero (and denormal-tiny) blocks give a finite multiplier
        inv = torch.reciprocal(scale).clamp_(max=_FP32_MAX)
        torch.mul(x, inv.unsqueeze(1), out=t)

    def _scaled(self, x: Tensor, scale: Tensor, work: _Work) -> Tensor:
        """Write the block scales of flat ``x`` into ``scale``; return ``x * (1/scale)`` (workspace)."""
        t = work.f32(x.numel())
        for s, e, rows, b in _block_pieces(x.numel(), self.block_size):
            self._scale_rows(x[s:e].view(rows, -1), scale[b : b + rows], t[s:e].view(rows, -1))
        return t

    def _rescale(self, out: Tensor, scale: Tensor) -> None:
        """``out *= scale`` block by block (the one rounding of the decode)."""
        for s, e, rows, b in _block_pieces(out.numel(), self.block_size):
            out[s:e].view(rows, -1).mul_(scale[b : b + rows].unsqueeze(1))

    def _triton(self, t: Tensor) -> Any:
        """The Triton kernel module for ``t``'s device if it reproduces this codec's reference bytes
        there (checked once per device, see :meth:`_triton_disagrees`); else None."""
        tk = _triton_module(t)
        if tk is None or self.block_size > _TRITON_MAX_BLOCK:
            return None
        key = (str(t.device), self.name)
        if key not in _TRITON_TRUSTED:
            problem = self._triton_disagrees(tk, t.device)
            if problem is None:
                _TRITON_TRUSTED[key] = True
            else:
                self._distrust_triton(t.device, problem)
        return tk if _TRITON_TRUSTED[key] else None

    def _tk_encode(self, tk: Any, x: Tensor, scales: Tensor, values: Tensor) -> None:
        tk.encode_blockwise(x, scales, values, self.block_size, int(self.bits), self.fp8, self.qmax, PACK_GROUP)

    def _tk_decode(self, tk: Any, values: Tensor, scales: Tensor, out: Tensor) -> None:
        tk.decode_blockwise(values, scales, out, self.block_size, int(self.bits), self.fp8, PACK_GROUP)

    def _run_triton(self, t: Tensor, call: Callable[[Any], None]) -> bool:
        """``call(kernels)`` if the Triton kernels are trusted on ``t``'s device; False if not run. A
        call that raises (say a specialization that does not compile) makes the codec distrust
        them there, and the caller takes another path."""
        tk = self._triton(t)
        if tk is None:
            return False
        try:
            call(tk)
        except Exception as e:  # noqa: BLE001
            self._distrust_triton(t.device, f"{type(e).__name__}: {e}")
            return False
        return True

    def _distrust_triton(self, device: torch.device, problem: str) -> None:
        _TRITON_TRUSTED[(str(device), self.name)] = False
        warnings.warn(f"lightning_islands: the Triton kernels of codec {self.name!r} on {device} failed their "
                      f"check ({problem}); this codec uses the slower torch path there (same bytes)", stacklevel=6)

    def _triton_disagrees(self, tk: Any, device: torch.device) -> str | None:
        """Encode and decode a probe (:mod:`lightning_islands.codec_probe`: exact and rounded ties,
        subnormal and near-overflow blocks; whole, and cut to a partial block and packing group)
        with the Triton kernels and with the torch path; None if every byte and every decoded bit
        agree, else what differed. A compiler that rounds differently must not change the wire
        format: it costs the fast path (with a warning), never the bit-identical merge."""
        whole = codec_probe.probe(self.block_size, self.qmax, self.fp8).to(device)
        try:
            for x in (whole, whole[: whole.numel() - 5]):
                problem = self._triton_differs_on(tk, x)
                if problem is not None:
                    return problem
        except Exception as e:  # noqa: BLE001 - a kernel that does not compile here is a reason to fall back
            return f"{type(e).__name__}: {e}"
        return None

    def _triton_differs_on(self, tk: Any, x: Tensor) -> str | None:
        n, bsz, device = x.numel(), self.block_size, x.device
        size = self._values_nbytes(n)
        ours, ref = (torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(2))
        split = 4 * _ceil_div(n, bsz)
        self._tk_encode(tk, x, ours[:split].view(torch.float32), ours[split:])
        with native.disabled():
            self._torch_encode(x, ref[:split].view(torch.float32), ref[split:])
            expected = torch.empty(n, device=device)
            self._decode_values(ref, n, expected)
        got = torch.empty(n, device=device)
        self._tk_decode(tk, ref[split:], ref[:split].view(torch.float32), got)
        if not torch.equal(ours, ref):
            return f"encode of {n} values differs from the torch path"
        if not torch.equal(got.view(torch.int32), expected.view(torch.int32)):
            return f"decode of {n} values differs from the torch path"
        return None

    def _encode_values(self, v: Tensor, body: Tensor) -> int | None:
        m = v.numel()
        bsz = self.block_size
        nblocks = _ceil_div(m, bsz)
        scales = body[: 4 * nblocks].view(torch.float32)
        values = body[4 * nblocks :]
        crc = None
        if not self._run_triton(v, lambda tk: self._tk_encode(tk, v, scales, values)):
            ran, crc = self._native_encode(v, scales, values)
            if not ran:
                self._torch_encode(v, scales, values)
        if nblocks and self._check_scales(v, scales):
            crc = None  # scales were nudged after they were checksummed
        return crc

    def _torch_encode(self, v: Tensor, scales: Tensor, values: Tensor) -> None:
        m = v.numel()
        bsz = self.block_size
        slab = self._slab_elems(v.device, m)
        work = _Work(v.device, min(slab, m))
        for s in range(0, m, slab):
            e = min(s + slab, m)
            b0 = s // self.pack
            self._encode_slab(
                v[s:e],
                scales[s // bsz : _ceil_div(e, bsz)],
                values[b0 : b0 + _ceil_div(e - s, self.pack)],
                work,
            )

    def _native_unit(self) -> int:
        """Alignment of the ranges handed to the fused kernels: whole blocks and packing groups."""
        return self.block_size if self.pack == 1 else math.lcm(self.block_size, PACK_GROUP)

    def _native_encode(self, v: Tensor, scales: Tensor, values: Tensor) -> tuple[bool, int | None]:
        """Encode with the fused CPU kernel if there is one: ``(True, the body's CRC-32 or None if
        the kernels did not take it)``; ``(False, None)`` (nothing done) to use the torch path."""
        return self._run_native(v, scales, values, "encode",
                                lambda lib, s, e, c: self._encode_range(lib, v, scales, values, s, e, c))

    def _native_decode(self, values: Tensor, scales: Tensor, out: Tensor) -> tuple[bool, int | None]:
        """Decode with the fused CPU kernel if there is one; returns as :meth:`_native_encode`."""
        return self._run_native(out, scales, values, "decode",
                                lambda lib, s, e, c: self._decode_range(lib, values, scales, out, s, e, c))

    def _run_native(self, vector: Tensor, scales: Tensor, values: Tensor, what: str,
                    call: Callable[[Any, int, int, int], int]) -> tuple[bool, int | None]:
        """Run ``call(lib, start, stop, crc)`` over unit-aligned ranges of the fp32 ``vector`` on the
        kernel threads, the kernel checksumming the matching pieces of ``scales`` and ``values``
        while they are in cache (:func:`_run_checksummed`). Returns ``(True, the CRC-32 of scales +
        values, i.e. the body, or None if the kernels did not take it)``, or ``(False, None)``
        (nothing run) if there are no fused kernels."""
        lib = _kernels(vector)
        if lib is None:
            return False, None
        bsz, pack = self.block_size, self.pack
        failed, crc = _run_checksummed(
            vector.numel(), self._native_unit(), lambda s, e, c: call(lib, s, e, c),
            lambda s, e: (scales[s // bsz : _ceil_div(e, bsz)], values[s // pack : _ceil_div(e, pack)]))
        if any(failed):
            raise MemoryError(f"fused {self.name} {what} could not allocate its scratch buffer")
        return True, crc

    # one kernel call on the unit-aligned value range [s, e), advancing the two CRC-32s at address
    # crc (scales, values); returns the kernel's status (0 = ok)
    def _encode_range(self, lib: Any, v: Tensor, scales: Tensor, values: Tensor, s: int, e: int, crc: int) -> int:
        raise NotImplementedError

    def _decode_range(self, lib: Any, values: Tensor, scales: Tensor, out: Tensor, s: int, e: int, crc: int) -> int:
        raise NotImplementedError

    def _check_scales(self, v: Tensor, scales: Tensor) -> bool:
        """Raise if a scale is non-finite; nudge scales whose decode could overflow. True if any
        scale was changed."""
        smax = float(scales.amax())
        if not math.isfinite(smax):
            err = _nonfinite_error(v)
            raise err if err is not None else ValueError("non-finite block scale")  # pragma: no cover
        if smax * self.qmax > 0.5 * _FP32_MAX:
            # Near the top of the fp32 range, qmax * fl(absmax/qmax) may round up to Inf. Nudge such
            # scales one ulp towards zero so every decodable q * scale stays finite.
            risky = torch.isinf(scales * self.qmax)
            if bool(risky.any()):
                nudged = torch.nextafter(scales, torch.zeros_like(scales))
                scales.copy_(torch.where(risky, nudged, scales))
                return True
        return False

    def _decode_values(self, body: Tensor, m: int, out: Tensor) -> int | None:
        bsz = self.block_size
        nblocks = _ceil_div(m, bsz)
        scales = body[: 4 * nblocks].view(torch.float32)
        values = body[4 * nblocks :]
        if self._run_triton(out, lambda tk: self._tk_decode(tk, values, scales, out[:m])):
            return None
        ran, crc = self._native_decode(values, scales, out[:m])
        if ran:
            return crc
        slab = self._slab_elems(body.device, m)
        work = _Work(body.device, min(slab, m))
        for s in range(0, m, slab):
            e = min(s + slab, m)
            b0 = s // self.pack
            self._decode_slab(
                values[b0 : b0 + _ceil_div(e - s, self.pack)],
                scales[s // bsz : _ceil_div(e, bsz)],
                out[s:e],
                work,
            )
        return None


class Float8Codec(_BlockCodec):
    """float8_e4m3fn values (1 byte) with one fp32 scale = absmax/448 per block.

    Relative error <= 2**-4 for values in the fp8 normal range (>= 2**-6 * scale); smaller
    values hit fp8 subnormals (absolute error <= 2**-10 * scale).
    """

    codec_id = _CODEC_IDS["fp8"]
    qmax = _FP8_MAX
    bits = 8.0
    fp8 = True

    def _encode_range(self, lib: Any, v: Tensor, scales: Tensor, values: Tensor, s: int, e: int, crc: int) -> int:
        bsz = self.block_size
        return lib.liq_fp8_encode(native.ptr(v, s), e - s, bsz, native.ptr(scales, s // bsz), native.ptr(values, s),
                                  crc)

    def _decode_range(self, lib: Any, values: Tensor, scales: Tensor, out: Tensor, s: int, e: int, crc: int) -> int:
        bsz = self.block_size
        return lib.liq_fp8_decode(native.ptr(values, s), native.ptr(scales, s // bsz), e - s, bsz, native.ptr(out, s),
                                  crc)

    def _encode_slab(self, x: Tensor, scale: Tensor, values: Tensor, work: _Work) -> None:
        t = self._scaled(x, scale, work)
        values.view(torch.float8_e4m3fn).copy_(t)  # round to nearest even; |t| <= 448

    def _decode_slab(self, values: Tensor, scale: Tensor, out: Tensor, work: _Work) -> None:
        # float8_e4m3fn -> fp32 by bit placement (the built-in CPU cast is scalar and ~6x slower):
        # sign-extend the byte, shift it so mantissa/exponent land at fp32 bits 20..26 and the sign
        # at bit 31, and rescale by 2**120 (exact). fp8 subnormals become fp32 subnormals, so this
        # equals ``.float()`` bit for bit (checked in the tests for all 254 finite codes).
        bits = out.view(torch.int32)
        bits.copy_(values.view(torch.int8))
        bits.bitwise_left_shift_(20).bitwise_and_(_FP8_BITS_MASK)
        out.mul_(2.0**120)
        self._rescale(out, scale)  # the one rounding: fp8 value * scale


class IntCodec(_BlockCodec):
    """Symmetric blockwise absmax integer quantization with 8, 4 or 2 bits per value.

    ``q = round_half_even(x * (1/scale))`` in [-qmax, qmax] (qmax = 2**(bits-1) - 1), scale =
    absmax/qmax stored as fp32 per block, decode ``q.float() * scale``.
    """

    def __init__(self, bits: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if bits not in (8, 4, 2):
            raise ValueError(f"IntCodec supports 8, 4 or 2 bits, got {bits}")
        self.codec_id = _CODEC_IDS[f"int{bits}"]
        self.bits = float(bits)
        self.qmax = float(2 ** (bits - 1) - 1)
        self.pack = 8 // bits
        super().__init__(block_size)

    def _encode_range(self, lib: Any, v: Tensor, scales: Tensor, values: Tensor, s: int, e: int, crc: int) -> int:
        bsz = self.block_size
        return lib.liq_int_encode(native.ptr(v, s), e - s, bsz, int(self.bits), native.ptr(scales, s // bsz),
                                  native.ptr(values, s // self.pack), crc)

    def _decode_range(self, lib: Any, values: Tensor, scales: Tensor, out: Tensor, s: int, e: int, crc: int) -> int:
        bsz = self.block_size
        return lib.liq_int_decode(native.ptr(values, s // self.pack), native.ptr(scales, s // bsz), e - s, bsz,
                                  int(self.bits), native.ptr(out, s), crc)

    def _encode_slab(self, x: Tensor, scale: Tensor, values: Tensor, work: _Work) -> None:
        t = self._scaled(x, scale, work)
        t.round_()  # half to even; |t| <= qmax (see module docstring), so no clamp is needed
        if self.pack == 1:
            values.view(torch.int8).copy_(t)
            return
        q = work.u8(t.numel())
        q.view(torch.int8).copy_(t)
        _pack_planar(q, values, self.pack)

    def _decode_slab(self, values: Tensor, scale: Tensor, out: Tensor, work: _Work) -> None:
        if self.pack == 1:
            out.copy_(values.view(torch.int8))
        else:
            q = work.u8(out.numel())
            _unpack_planar(values, q, self.pack)
            out.copy_(q.view(torch.int8))
        self._rescale(out, scale)  # the one rounding: q.float() * scale


def _mean_abs_rows(x: Tensor, scale: Tensor, span: int) -> None:
    """Per row of ``x``: ``scale = fl32(sum|x| / width)``, the sum taken in float64 over a fixed
    pairwise tree of ``span`` (a power of two >= the width) leaves, missing leaves being zero.

    Every step is an element-wise IEEE operation in a fixed order, so the result does not depend
    on the device or on how a library would order a reduction; float64 cannot overflow on a sum of
    fp32 magnitudes, and the mean (at most the largest |x|) rounds to a finite fp32. A NaN or Inf
    in a row makes its scale NaN or Inf (refused after encoding, as for the other codecs). Levels
    whose partner leaves are all zero add exact zeros, so a short row (a partial last block) runs
    the same tree over the next power of two above its width.
    """
    rows, width = x.shape
    span = min(span, 1 << (width - 1).bit_length())
    a = x.abs().to(torch.float64)
    if width < span:
        a = torch.cat([a, a.new_zeros(rows, span - width)], dim=1)
    while a.shape[1] > 1:
        half = a.shape[1] // 2
        a = a[:, :half] + a[:, half:]
    # a device tensor as divisor: CUDA would multiply by the reciprocal of a host scalar
    scale.copy_(a[:, 0].div_(a.new_full((), width)))


def _sign_flip(out: Tensor, bits: Tensor, scale: Tensor, block: int) -> None:
    """``out = scale`` of each element's block with its sign bit flipped where ``bits`` is 1.

    A bit operation on the scale's fp32 pattern, not an arithmetic negation, so it is exact and the
    same on every device for any scale bits a payload may carry (the C kernels do the same).
    """
    o = out.view(torch.int32)
    o.copy_(bits).bitwise_left_shift_(31)  # 1 -> 0x80000000, 0 -> 0
    sb = scale.view(torch.int32)
    for s, e, rows, b in _block_pieces(out.numel(), block):
        o[s:e].view(rows, -1).bitwise_xor_(sb[b : b + rows].unsqueeze(1))


class SignCodec(_BlockCodec):
    """One bit per value: its sign, with one fp32 scale per block = the block's mean ``|x|``.

    Decode is ``+scale`` or ``-scale`` (``-0.0`` counts as negative; the sign bit of the scale is
    flipped, so decoding involves no arithmetic). For a sign code the block mean
    of ``|x|`` is the magnitude with the least squared error, so on Gaussian-like blocks the
    relative L2 error is about ``sqrt(1 - 2/pi) = 0.60``, below int2's ~0.77 (whose absmax scale
    rounds most values of a block to zero) at half the value bits: 1.25 bits per value at block
    128 (25.6x smaller than fp32). Meant for frequent exchanges with error feedback (on by default).
    """

    codec_id = _CODEC_IDS["sign"]
    bits = 1.0
    pack = 8

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        super().__init__(block_size)
        self._span = 1 << (block_size - 1).bit_length()

    def _triton(self, t: Tensor) -> Any:
        return None  # the torch path on GPUs (no Triton kernel for this codec yet)

    def _slab_elems(self, device: torch.device, m: int) -> int:
        if device.type == "cpu":
            return super()._slab_elems(device, m)
        # GPUs: slabs of ~16M values bound the float64 temporaries of the scale tree (~0.5 GB)
        unit = self._native_unit()
        return max(1, (1 << 24) // unit) * unit

    def _encode_range(self, lib: Any, v: Tensor, scales: Tensor, values: Tensor, s: int, e: int, crc: int) -> int:
        bsz = self.block_size
        return lib.liq_sign_encode(native.ptr(v, s), e - s, bsz, native.ptr(scales, s // bsz),
                                   native.ptr(values, s // 8), crc)

    def _decode_range(self, lib: Any, values: Tensor, scales: Tensor, out: Tensor, s: int, e: int, crc: int) -> int:
        bsz = self.block_size
        return lib.liq_sign_decode(native.ptr(values, s // 8), native.ptr(scales, s // bsz), e - s, bsz,
                                   native.ptr(out, s), crc)

    def _encode_slab(self, x: Tensor, scale: Tensor, values: Tensor, work: _Work) -> None:
        count = x.numel()
        for s, e, rows, b in _block_pieces(count, self.block_size):
            _mean_abs_rows(x[s:e].view(rows, -1), scale[b : b + rows], self._span)
        q = work.u8(count)
        torch.signbit(x, out=q.view(torch.bool))
        _pack_planar(q, values, self.pack)

    def _decode_slab(self, values: Tensor, scale: Tensor, out: Tensor, work: _Work) -> None:
        q = work.u8(out.numel())
        _unpack_planar(values, q, self.pack)
        _sign_flip(out, q, scale, self.block_size)  # no rounding at all


# ----------------------------------------------------------------------------------------------
# top-k sparsification with Elias-Fano indices
# ----------------------------------------------------------------------------------------------


def _ef_layout(n: int, k: int) -> tuple[int, int, int]:
    """(low bit count l, low-part bytes, high-part bytes) of Elias-Fano for k of n indices."""
    if k == 0:
        return 0, 0, 0
    low = (n // k).bit_length() - 1  # floor(log2(n / k)) for n >= k >= 1
    high_bits = k + ((n - 1) >> low) + 1
    return low, _ceil_div(k * low, 8), _ceil_div(high_bits, 8)


def _pack_bits(bits: Tensor, nbytes: int) -> Tensor:
    """uint8 0/1 vector -> bytes, LSB first; zero-padded to ``nbytes``."""
    pad = nbytes * 8 - bits.numel()
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=bits.device)
    return (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(data: Tensor) -> Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=data.device)
    return ((data.unsqueeze(1) >> shifts) & 1).view(-1)


def _ef_encode(idx: Tensor, n: int, out: Tensor) -> None:
    """Elias-Fano code strictly increasing int64 indices into ``out`` (exactly the layout size)."""
    k = idx.numel()
    low, low_bytes, high_bytes = _ef_layout(n, k)
    if k == 0:
        return
    lib = _kernels(out)
    if lib is not None:
        idx = idx.contiguous()
        lib.liq_ef_encode(native.ptr(idx), k, low, native.ptr(out), low_bytes, native.ptr(out, low_bytes), high_bytes)
        return
    if low:
        shifts = torch.arange(low, dtype=torch.int64, device=idx.device)
        bits = ((idx.unsqueeze(1) >> shifts) & 1).to(torch.uint8).view(-1)
        out[:low_bytes].copy_(_pack_bits(bits, low_bytes))
    positions = (idx >> low) + torch.arange(k, dtype=torch.int64, device=idx.device)
    unary = torch.zeros(high_bytes * 8, dtype=torch.uint8, device=idx.device)
    unary[positions] = 1
    out[low_bytes:].copy_(_pack_bits(unary, high_bytes))


def _ef_decode(data: Tensor, n: int, k: int) -> Tensor:
    low, low_bytes, high_bytes = _ef_layout(n, k)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device)
    lib = _kernels(data)
    if lib is not None:
        data = data.contiguous()
        idx = torch.empty(k, dtype=torch.int64)
        status = lib.liq_ef_decode(native.ptr(data), n, k, low, low_bytes, high_bytes, native.ptr(idx))
        if status == -1:
            raise ValueError(f"corrupt top-k index block: the index marks do not number k={k}")
        if status:
            raise ValueError(f"corrupt top-k index block: indices not strictly increasing below n={n}")
        return idx
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


def _magnitude_bits(x: Tensor) -> Tensor:
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
    rank = min(sample.numel(), 2 * _ceil_div(k * sample.numel(), n) + 32)
    estimate = torch.topk(sample, rank, sorted=False).values.min()
    candidates = a[a >= estimate]
    if candidates.numel() < k:  # pragma: no cover - needs a very unlucky sample
        candidates = a
    return torch.topk(candidates, k, sorted=False).values.min()


def _topk_indices(a: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries of ``a`` in increasing order; torch path. ``a`` holds
    magnitudes as :func:`_magnitude_bits` (or any non-negative values without NaN).

    The selection rule, shared with the fused kernel and every device: all entries above the
    k-th largest value, then the lowest-index entries equal to it until there are k.
    """
    threshold = _kth_largest(a, k)
    above = torch.nonzero(a > threshold).view(-1)
    ties = torch.nonzero(a == threshold).view(-1)[: k - above.numel()]
    return torch.cat([above, ties]).sort().values


def _native_topk(lib: Any, x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(indices, values) of the top-k magnitudes of ``x`` with the fused kernels; same rule as
    :func:`_topk_indices`. Usually one pass over ``x``, split across the kernel threads, that
    picks every entry at or above a band of magnitudes guessed from a sample (with the band's
    count, the threshold follows); a poor guess costs a histogram pass that finds the band
    exactly, and a second pick."""
    n = x.numel()
    ranges = native.split(n, 1)
    guess = _sampled_band(x, k)
    if guess is not None:
        lo, hi, expected = guess
        # a range may hold any share of the k largest and of the band (layers differ in scale): room for
        # all of both (the pages of unused room are never touched)
        caps = [min(e - s, k + expected + 256) + _TOPK_SLACK for s, e in ranges]
        found = _band_pick(lib, x, k, ranges, lo, hi, caps)
        if found is not None:
            return found
    hist = torch.zeros(len(ranges), _TOPK_BUCKETS, dtype=torch.int64)
    status = native.run_each(range(len(ranges)), lambda r: lib.liq_topk_hist(
        native.ptr(x, ranges[r][0]), ranges[r][1] - ranges[r][0], native.ptr(hist[r])))
    if any(st < 0 for st in status):
        raise MemoryError("fused top-k could not allocate its histogram")
    if any(status):
        _raise_if_nonfinite_sum(x)  # raises: the kernel saw a NaN/Inf
    from_top = hist.sum(0).flip(0).cumsum(0)
    bucket = _TOPK_BUCKETS - 1 - int(torch.searchsorted(from_top, k))  # first bucket reaching k
    shift = _TOPK_BUCKET_SHIFT
    caps = (hist[:, bucket:].sum(1) + _TOPK_SLACK).tolist()  # exactly the entries >= the bucket, per range
    found = _band_pick(lib, x, k, ranges, bucket << shift, (bucket + 1) << shift, caps)
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
    runs = _TOPK_SAMPLE // _TOPK_SAMPLE_RUN
    starts = torch.arange(runs, dtype=torch.int64) * (n // runs)
    where = (starts.unsqueeze(1) + torch.arange(_TOPK_SAMPLE_RUN, dtype=torch.int64)).view(-1)
    sample = _magnitude_bits(x.index_select(0, where))
    m = sample.numel()
    mean = m * k / n  # expected sample entries at or above the threshold
    margin = 4.0 * math.sqrt(mean) + 8
    top, bottom = math.floor(mean - margin), math.ceil(mean + margin)
    ranked = torch.topk(sample, min(bottom + 1, m)).values  # descending
    hi = int(ranked[top]) + 1 if top >= 0 else _INF_BITS
    lo = int(ranked[bottom]) if bottom < m else 0
    inside = int(((sample >= lo) & (sample < hi)).sum())
    return lo, hi, _ceil_div(n * (inside + 16), m) * 3 // 2


def _band_pick(lib: Any, x: Tensor, k: int, ranges: list[tuple[int, int]], lo: int, hi: int,
               caps: list[int]) -> tuple[Tensor, Tensor] | None:
    """The top-k of ``x`` if the k-th largest magnitude lies in the band [lo, hi) of bit patterns
    and each range has at most ``caps[r] - _TOPK_SLACK`` entries at or above ``lo``; else None."""
    each = range(len(ranges))
    starts = [0, *itertools.accumulate(caps)]
    idx_all = torch.empty(starts[-1], dtype=torch.int64)
    val_all = torch.empty(starts[-1], dtype=torch.float32)
    above = torch.zeros(len(ranges), dtype=torch.int64)
    got = native.run_each(each, lambda r: lib.liq_topk_pick(
        native.ptr(x, ranges[r][0]), ranges[r][1] - ranges[r][0], ranges[r][0], lo, hi,
        native.ptr(idx_all, starts[r]), native.ptr(val_all, starts[r]), caps[r], native.ptr(above, r)))
    if any(g == -2 for g in got):
        _raise_if_nonfinite_sum(x)  # raises: the kernel saw a NaN/Inf
    n_above = int(above.sum())
    if any(g < 0 for g in got) or not n_above < k <= sum(got):
        return None
    band = torch.empty(sum(got) - n_above + 1, dtype=torch.int32)  # their bits (+1: stored branch-free)
    off = 0
    for r in each:
        off += lib.liq_topk_band_bits(native.ptr(val_all, starts[r]), got[r], hi, native.ptr(band, off))
    rank = k - n_above  # the threshold is the rank-th largest entry inside the band
    inside = band[:off].numpy()
    threshold = int(np.partition(inside, inside.size - rank)[inside.size - rank])
    ties = torch.tensor([k - n_above - int(np.count_nonzero(inside > threshold))])  # ties go to the lowest indices
    idx = torch.empty(k, dtype=torch.int64)
    vals = torch.empty(k, dtype=torch.float32)
    off = 0
    for r in each:  # in index order
        off += lib.liq_topk_keep(native.ptr(idx_all, starts[r]), native.ptr(val_all, starts[r]), got[r], threshold,
                                 native.ptr(ties), native.ptr(idx, off), native.ptr(vals, off))
    if off != k:  # pragma: no cover - would be a kernel bug
        raise RuntimeError(f"fused top-k kept {off} entries, expected {k}")
    return idx, vals


class TopKCodec(Codec):
    """Keep the ``ceil(fraction * n)`` largest-magnitude entries; values via an inner codec.

    Indices travel Elias-Fano coded (see the module docstring); values in increasing index
    order, encoded by ``inner`` (fp32 by default) without its own header. Ties at the k-th
    largest magnitude go to the lowest indices, so the kept set (and the payload) is the same
    on every device and path.
    """

    kind = _KIND_TOPK

    def __init__(self, fraction: str | float | Fraction, inner: Codec | None = None) -> None:
        frac = Fraction(str(fraction)) if not isinstance(fraction, Fraction) else fraction
        if not 0 < frac <= 1:
            raise ValueError(f"top-k fraction must be in (0, 1], got {fraction}")
        inner = inner if inner is not None else Float32Codec()
        if isinstance(inner, TopKCodec):
            raise ValueError("top-k cannot wrap another top-k codec")
        self.fraction = frac
        self.inner = inner
        self.codec_id = inner.codec_id
        self.block_size = inner.block_size
        self.bits = inner.bits
        frac_text = _fmt_fraction(frac)
        self.name = f"topk:{frac_text}" if isinstance(inner, Float32Codec) else f"topk:{frac_text}+{inner.name}"

    def _count(self, n: int) -> int:
        return min(n, _ceil_div(n * self.fraction.numerator, self.fraction.denominator))

    def _body_nbytes(self, n: int) -> int:
        k = self._count(n)
        _, low_bytes, high_bytes = _ef_layout(n, k)
        return self.inner._values_nbytes(k) + low_bytes + high_bytes

    def _encode_body(self, x: Tensor, body: Tensor) -> int | None:
        n = x.numel()
        k = self._count(n)
        lib = _kernels(x)
        if k < n and lib is not None:
            idx, values = _native_topk(lib, x, k)  # refuses NaN/Inf in its first pass
        elif k == n:
            _raise_if_nonfinite_sum(x)
            idx = torch.arange(n, dtype=torch.int64, device=x.device)
            values = x
        else:
            _raise_if_nonfinite_sum(x)
            idx = _topk_indices(_magnitude_bits(x), k)
            values = x.index_select(0, idx)
        inner_bytes = self.inner._values_nbytes(k)
        inner_crc = self.inner._encode_values(values, body[:inner_bytes]) if k else None
        _ef_encode(idx, n, body[inner_bytes:])
        if inner_crc is None:
            return None
        ef_crc, ef_bytes = _crc_piece(body[inner_bytes:])  # the index part is small: the values took the pass
        return crc32_combine(inner_crc, ef_crc, ef_bytes)

    def _checksums_while_decoding(self, body: Tensor) -> bool:
        return False  # the body is index-decoded first: verify it before trusting its indices

    def _decode_body(self, body: Tensor, n: int, k: int, out: Tensor) -> None:
        inner_bytes = self.inner._values_nbytes(k)
        values = torch.empty(k, dtype=torch.float32, device=body.device)
        if k:
            self.inner._decode_values(body[:inner_bytes], k, values)
        idx = _ef_decode(body[inner_bytes:], n, k)
        if k == n:
            out.copy_(values)
            return
        lib = _kernels(out)
        if lib is None:
            out.zero_()
            out.index_copy_(0, idx, values)  # unique indices: deterministic
            return
        ranges = native.split(n, 1)
        cuts = torch.searchsorted(idx, torch.tensor([s for s, _ in ranges] + [n])).tolist()
        native.run_each(range(len(ranges)), lambda r: lib.liq_topk_scatter(
            native.ptr(idx, cuts[r]), native.ptr(values, cuts[r]), cuts[r + 1] - cuts[r], ranges[r][0], ranges[r][1],
            native.ptr(out)))

    def spec(self) -> dict[str, Any]:
        """Wire-format description including the top-k fraction and index encoding."""
        d = super().spec()
        d.update(
            k_fraction=_fmt_fraction(self.fraction),
            index_encoding="elias-fano",
            inner=self.inner.name,
        )
        return d


# ----------------------------------------------------------------------------------------------
# factory
# ----------------------------------------------------------------------------------------------

_SPEC_HELP = (
    "expected 'fp32', 'bf16', 'fp8', 'int8', 'int4', 'int2' or 'sign', optionally with '/<block size>' "
    "(e.g. 'int4/64'), or 'topk:<fraction>' / 'topk:<fraction>+<codec>' (e.g. 'topk:0.01+int4')"
)


def _make_base(text: str, block_size: int, spec: str) -> Codec:
    name, _, block_text = text.partition("/")
    name = name.strip()
    if block_text:
        try:
            block_size = int(block_text)
        except ValueError:
            raise ValueError(f"bad block size {block_text!r} in codec spec {spec!r}") from None
    if name == "fp32":
        return Float32Codec()
    if name == "bf16":
        return BFloat16Codec()
    if name == "fp8":
        return Float8Codec(block_size)
    if name in ("int8", "int4", "int2"):
        return IntCodec(int(name[3:]), block_size)
    if name == "sign":
        return SignCodec(block_size)
    raise ValueError(f"unknown codec {name!r} in spec {spec!r}: {_SPEC_HELP}")


def make_codec(spec: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Codec:
    """Build a codec from a spec string such as ``"int4"``, ``"int8/64"``, ``"topk:0.01+int4"``.

    ``block_size`` applies to blockwise codecs unless the spec names one (``"int4/64"``).
    ``make_codec(codec.name)`` rebuilds an equal codec.
    """
    if not isinstance(spec, str):
        raise TypeError(f"codec spec must be a str, got {type(spec).__name__}")
    text = spec.strip().lower()
    if not text:
        raise ValueError(f"empty codec spec: {_SPEC_HELP}")
    if text.startswith("topk:"):
        frac_text, plus, inner_text = text[5:].partition("+")
        if "/" in frac_text:
            raise ValueError(
                f"bad top-k fraction {frac_text!r} in codec spec {spec!r}: write it as a decimal "
                f"(e.g. 0.01) and put any block size on the inner codec, e.g. 'topk:0.01+int4/64'"
            )
        try:
            frac = Fraction(frac_text.strip())
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"bad top-k fraction {frac_text!r} in codec spec {spec!r}: {_SPEC_HELP}") from None
        inner = _make_base(inner_text, block_size, spec) if plus else Float32Codec()
        return TopKCodec(frac, inner)
    return _make_base(text, block_size, spec)


def default_error_feedback(codec_spec: str | Codec) -> bool:
    """Whether error feedback should be on by default: yes for <= 4 bits and for any top-k."""
    codec = make_codec(codec_spec) if isinstance(codec_spec, str) else codec_spec
    return isinstance(codec, TopKCodec) or codec.bits <= 4


# ----------------------------------------------------------------------------------------------
# error feedback and metrics
# ----------------------------------------------------------------------------------------------


class ErrorFeedback:
    """Carries the quantization residual of one island into its next pseudo-gradient.

    Usage per outer step::

        c = ef.compensate(pseudo_grad)      # pseudo_grad + residual
        payload = codec.encode(c)
        mine = codec.decode(payload)        # what the other islands will see from us
        ef.update(c, mine)                  # residual = c - mine

    Over many rounds the running sum of what was transmitted tracks the running sum of the true
    pseudo-gradients to within one round's quantization error instead of drifting.
    """

    def __init__(self) -> None:
        self.residual: Tensor | None = None

    def compensate(self, x: Tensor) -> Tensor:
        """``x + residual`` (a new tensor); ``x`` itself while there is no residual yet."""
        if self.residual is None:
            return x
        if self.residual.shape != x.shape:
            raise ValueError(
                f"error-feedback residual has shape {tuple(self.residual.shape)} but the pseudo-gradient "
                f"has shape {tuple(x.shape)}; call reset() after changing the model"
            )
        return x + self.residual.to(device=x.device, dtype=x.dtype)

    def update(self, compensated: Tensor, decoded: Tensor) -> None:
        """Store ``compensated - decoded`` as the residual for the next round."""
        if compensated.shape != decoded.shape:
            raise ValueError(
                f"shape mismatch: compensated {tuple(compensated.shape)} vs decoded {tuple(decoded.shape)}"
            )
        if (
            self.residual is not None
            and self.residual.shape == compensated.shape
            and self.residual.device == compensated.device
            and self.residual.dtype == compensated.dtype
            and self.residual.data_ptr() not in (compensated.data_ptr(), decoded.data_ptr())
        ):
            torch.sub(compensated, decoded, out=self.residual)
        else:
            self.residual = compensated - decoded

    def reset(self) -> None:
        """Drop the residual (e.g. after a model change or a divergence restart)."""
        self.residual = None

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: ``{"residual": Tensor | None}``, on the CPU (so a checkpoint taken on
        a GPU loads anywhere; :meth:`compensate` moves the residual to the data's device)."""
        return {"residual": None if self.residual is None else self.residual.detach().to("cpu", copy=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state produced by :meth:`state_dict`."""
        if "residual" not in state:
            raise ValueError(f"error-feedback state must contain 'residual', got keys {sorted(state)}")
        residual = state["residual"]
        if residual is not None and not isinstance(residual, Tensor):
            raise TypeError(f"residual must be a Tensor or None, got {type(residual).__name__}")
        self.residual = None if residual is None else residual.detach().clone()


def quantization_error(x: Tensor, decoded: Tensor) -> float:
    """Relative L2 error ``||x - decoded|| / ||x||`` (in float64); 0.0 when x is all zeros."""
    if x.shape != decoded.shape:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs {tuple(decoded.shape)}")
    xd = x.detach().to(torch.float64)
    norm = float(torch.linalg.vector_norm(xd))
    diff = float(torch.linalg.vector_norm(xd - decoded.detach().to(device=x.device, dtype=torch.float64)))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def compression_ratio(n: int, payload_bytes: int) -> float:
    """fp32 size over payload size: ``4 * n / payload_bytes``."""
    if payload_bytes <= 0:
        raise ValueError(f"payload_bytes must be positive, got {payload_bytes}")
    return 4.0 * n / payload_bytes
