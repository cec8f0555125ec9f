"""Blockwise codecs: one fp32 scale per block, values as fp8 or 8/4/2-bit integers.

:class:`BlockCodec` holds what they share: the absmax scales, cache-blocked slabs on CPU, the
partial last block, and the choice between the Triton kernels (trusted per device only after they
reproduced the torch path's bytes on a probe) and the torch path.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_islands.codecs import paths
from lightning_islands.codecs import probe as codec_probe
from lightning_islands.codecs.base import Codec, nonfinite_error
from lightning_islands.codecs.buffers import Buffers
from lightning_islands.codecs.packing import pack_planar, unpack_planar
from lightning_islands.codecs.wire import (
    CODEC_IDS,
    CODEC_NAMES,
    DEFAULT_BLOCK_SIZE,
    MAX_BLOCK_SIZE,
    PACK_GROUP,
    block_pieces,
    ceil_div,
)

_CPU_SLAB_ELEMS = 1 << 20  # elements per cache-blocked slab on CPU (4 MiB of fp32, L3-resident)


FP32_MAX = torch.finfo(torch.float32).max


_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_FP8_BITS_MASK = 0x87F00000 - (1 << 32)  # fp32 bit 31 and bits 20..26, as a signed int32


TRITON_TRUSTED: dict[tuple[str, str], bool] = {}  # (device, codec name) -> Triton kernels agree there
_TRITON_MAX_BLOCK = 1 << 20  # larger blocks keep the torch path on GPUs (their probe would be too big)


class BlockCodec(Codec):
    """Shared machinery: per-block fp32 absmax scales, cache-blocked slabs, partial last block."""

    pack = 1  # values per byte
    qmax = 1.0
    fp8 = False  # values are float8_e4m3fn codes (else two's complement / offset binary ints)

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
        if block_size <= 0 or block_size % 4 or block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be a positive multiple of 4 and <= {MAX_BLOCK_SIZE}, got {block_size}")
        self.block_size = block_size
        self.name = f"{CODEC_NAMES[self.codec_id]}/{block_size}"

    def _values_nbytes(self, m: int) -> int:
        return 4 * ceil_div(m, self.block_size) + ceil_div(m, self.pack)

    def _slab_elems(self, device: torch.device, m: int) -> int:
        """Slab length: a multiple of the block size and (if packed) of the packing group."""
        unit = self.alignment
        if device.type != "cpu":
            return max(unit, m)  # one slab: no cache blocking needed, fewer kernel launches
        return max(1, _CPU_SLAB_ELEMS // unit) * unit

    # per-slab steps of the torch path: x / out are flat slices of whole blocks (the last may be
    # partial), scale the matching fp32 scales, values the matching packed bytes; work holds the
    # temporaries that the slabs of one call share
    def _encode_slab(self, x: Tensor, scale: Tensor, values: Tensor, work: Buffers) -> None:
        raise NotImplementedError

    def _decode_slab(self, values: Tensor, scale: Tensor, out: Tensor, work: Buffers) -> None:
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
        inv = torch.reciprocal(scale).clamp_(max=FP32_MAX)
        torch.mul(x, inv.unsqueeze(1), out=t)

    def _scaled(self, x: Tensor, scale: Tensor, work: Buffers) -> Tensor:
        """Write the block scales of flat ``x`` into ``scale``; return ``x * (1/scale)`` (workspace)."""
        t = work.take("scaled", x.numel(), device=x.device)
        for s, e, rows, b in block_pieces(x.numel(), self.block_size):
            self._scale_rows(x[s:e].view(rows, -1), scale[b : b + rows], t[s:e].view(rows, -1))
        return t

    def _rescale(self, out: Tensor, scale: Tensor) -> None:
        """``out *= scale`` block by block (the one rounding of the decode)."""
        for s, e, rows, b in block_pieces(out.numel(), self.block_size):
            out[s:e].view(rows, -1).mul_(scale[b : b + rows].unsqueeze(1))

    def _triton(self, t: Tensor) -> Any:
        """The Triton kernel module for ``t``'s device if it reproduces this codec's reference bytes
        there (checked once per device, see :meth:`_triton_disagrees`); else None."""
        tk = paths.triton_module(t)
        if tk is None or self.block_size > _TRITON_MAX_BLOCK:
            return None
        key = (str(t.device), self.name)
        if key not in TRITON_TRUSTED:
            problem = self._triton_disagrees(tk, t.device)
            if problem is None:
                TRITON_TRUSTED[key] = True
            else:
                self._distrust_triton(t.device, problem)
        return tk if TRITON_TRUSTED[key] else None

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
        TRITON_TRUSTED[(str(device), self.name)] = False
        warnings.warn(f"lightning_islands: the Triton kernels of codec {self.name!r} on {device} failed their "
                      f"check ({problem}); this codec uses the slower torch path there (same bytes)", stacklevel=6)

    def _triton_disagrees(self, tk: Any, device: torch.device) -> str | None:
        """Encode and decode a probe (:mod:`lightning_islands.codecs.probe`: exact and rounded ties,
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
        n, device = x.numel(), x.device
        size = self._values_nbytes(n)
        ours, ref = (torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(2))
        self._tk_encode(tk, x, *self._body_parts(ours, n))
        ref_scales, ref_values = self._body_parts(ref, n)
        self._torch_encode(x, ref_scales, ref_values)
        expected = torch.empty(n, device=device)
        self._torch_decode(ref_values, ref_scales, expected)
        got = torch.empty(n, device=device)
        self._tk_decode(tk, ref_values, ref_scales, got)
        if not torch.equal(ours, ref):
            return f"encode of {n} values differs from the torch path"
        if not torch.equal(got.view(torch.int32), expected.view(torch.int32)):
            return f"decode of {n} values differs from the torch path"
        return None

    def _body_parts(self, body: Tensor, m: int) -> tuple[Tensor, Tensor]:
        """A body carrying ``m`` values cut into its fp32 block scales and its (packed) values."""
        nblocks = ceil_div(m, self.block_size)
        return body[: 4 * nblocks].view(torch.float32), body[4 * nblocks :]

    def _slabs(self, device: torch.device, m: int, scales: Tensor,
               values: Tensor) -> Iterator[tuple[slice, Tensor, Tensor, Buffers]]:
        """The torch path's pieces of ``m`` values: ``(their range, their scales, their values, the
        scratch buffers all slabs share)``."""
        bsz = self.block_size
        slab = self._slab_elems(device, m)
        work = Buffers()
        for s in range(0, m, slab):
            e = min(s + slab, m)
            b0 = s // self.pack
            yield slice(s, e), scales[s // bsz : ceil_div(e, bsz)], values[b0 : b0 + ceil_div(e - s, self.pack)], work

    def _encode_values(self, v: Tensor, body: Tensor) -> None:
        scales, values = self._body_parts(body, v.numel())
        if not self._run_triton(v, lambda tk: self._tk_encode(tk, v, scales, values)):
            self._torch_encode(v, scales, values)
        if scales.numel():
            self._check_scales(v, scales)

    def _torch_encode(self, v: Tensor, scales: Tensor, values: Tensor) -> None:
        """The reference encoder: the block scales and packed values of ``v``, a slab at a time."""
        for span, scale, packed, work in self._slabs(v.device, v.numel(), scales, values):
            self._encode_slab(v[span], scale, packed, work)

    def _torch_decode(self, values: Tensor, scales: Tensor, out: Tensor) -> None:
        """The reference decoder: ``out`` (as many values as it holds) from packed values and scales."""
        for span, scale, packed, work in self._slabs(out.device, out.numel(), scales, values):
            self._decode_slab(packed, scale, out[span], work)

    @property
    def alignment(self) -> int:
        """Whole blocks and (packed values) whole packing groups: see :attr:`Codec.alignment`. Also
        the alignment of the slabs."""
        return self.block_size if self.pack == 1 else math.lcm(self.block_size, PACK_GROUP)

    def _check_scales(self, v: Tensor, scales: Tensor) -> None:
        """Raise if a scale is non-finite; nudge scales whose decode could overflow."""
        smax = float(scales.amax())
        if not math.isfinite(smax):
            err = nonfinite_error(v)
            raise err if err is not None else ValueError("non-finite block scale")  # pragma: no cover
        if smax * self.qmax > 0.5 * FP32_MAX:
            # Near the top of the fp32 range, qmax * fl(absmax/qmax) may round up to Inf. Nudge such
            # scales one ulp towards zero so every decodable q * scale stays finite.
            risky = torch.isinf(scales * self.qmax)
            if bool(risky.any()):
                nudged = torch.nextafter(scales, torch.zeros_like(scales))
                scales.copy_(torch.where(risky, nudged, scales))

    def _decode_values(self, body: Tensor, m: int, out: Tensor) -> None:
        scales, values = self._body_parts(body, m)
        if not self._run_triton(out, lambda tk: self._tk_decode(tk, values, scales, out[:m])):
            self._torch_decode(values, scales, out[:m])


class Float8Codec(BlockCodec):
    """float8_e4m3fn values (1 byte) with one fp32 scale = absmax/448 per block.

    Relative error <= 2**-4 for values in the fp8 normal range (>= 2**-6 * scale); smaller
    values hit fp8 subnormals (absolute error <= 2**-10 * scale).
    """

    codec_id = CODEC_IDS["fp8"]
    qmax = _FP8_MAX
    bits = 8.0
    fp8 = True

    def _encode_slab(self, x: Tensor, scale: Tensor, values: Tensor, work: Buffers) -> None:
        t = self._scaled(x, scale, work)
        values.view(torch.float8_e4m3fn).copy_(t)  # round to nearest even; |t| <= 448

    def _decode_slab(self, values: Tensor, scale: Tensor, out: Tensor, work: Buffers) -> None:
        # float8_e4m3fn -> fp32 by bit placement (the built-in CPU cast is scalar and ~6x slower):
        # sign-extend the byte, shift it so mantissa/exponent land at fp32 bits 20..26 and the sign
        # at bit 31, and rescale by 2**120 (exact). fp8 subnormals become fp32 subnormals, so this
        # equals ``.float()`` bit for bit (checked in the tests for all 254 finite codes).
        bits = out.view(torch.int32)
        bits.copy_(values.view(torch.int8))
        bits.bitwise_left_shift_(20).bitwise_and_(_FP8_BITS_MASK)
        out.mul_(2.0**120)
        self._rescale(out, scale)  # the one rounding: fp8 value * scale


class IntCodec(BlockCodec):
    """Symmetric blockwise absmax integer quantization with 8, 4 or 2 bits per value.

    ``q = round_half_even(x * (1/scale))`` in [-qmax, qmax] (qmax = 2**(bits-1) - 1), scale =
    absmax/qmax stored as fp32 per block, decode ``q.float() * scale``.
    """

    def __init__(self, bits: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if bits not in (8, 4, 2):
            raise ValueError(f"IntCodec supports 8, 4 or 2 bits, got {bits}")
        self.codec_id = CODEC_IDS[f"int{bits}"]
        self.bits = float(bits)
        self.qmax = float(2 ** (bits - 1) - 1)
        self.pack = 8 // bits
        super().__init__(block_size)

    def _encode_slab(self, x: Tensor, scale: Tensor, values: Tensor, work: Buffers) -> None:
        t = self._scaled(x, scale, work)
        t.round_()  # half to even; |t| <= qmax (see :mod:`lightning_islands.codecs.wire`), so no clamp is needed
        if self.pack == 1:
            values.view(torch.int8).copy_(t)
            return
        q = work.take("codes", t.numel(), torch.uint8, x.device)
        q.view(torch.int8).copy_(t)
        pack_planar(q, values, self.pack)

    def _decode_slab(self, values: Tensor, scale: Tensor, out: Tensor, work: Buffers) -> None:
        if self.pack == 1:
            out.copy_(values.view(torch.int8))
        else:
            q = work.take("codes", out.numel(), torch.uint8, out.device)
            unpack_planar(values, q, self.pack)
            out.copy_(q.view(torch.int8))
        self._rescale(out, scale)  # the one rounding: q.float() * scale
