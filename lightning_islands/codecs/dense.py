"""Element-wise codecs without blocks: raw fp32 and bfloat16."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_islands import native
from lightning_islands.codecs import paths
from lightning_islands.codecs.base import Codec, nonfinite_error, raise_if_nonfinite_sum
from lightning_islands.codecs.checksum import run_checksummed
from lightning_islands.codecs.wire import CODEC_IDS

_BF16_MAX = torch.finfo(torch.bfloat16).max


def _run_elementwise(kernel: str, count: int, src: Tensor, dst: Tensor, body: Tensor) -> tuple[list[int], int | None]:
    """The fused kernel ``kernel(src, n, dst, crc)`` over ``count`` elements on the kernel threads,
    in pieces of multiples of 16, checksumming ``body`` (``src`` when decoding, ``dst`` when
    encoding) as it goes: the kernel statuses and the body's CRC-32 (see :func:`run_checksummed`)."""
    return run_checksummed(count, 16, lambda s, e, c: (kernel, (native.ptr(src, s), e - s, native.ptr(dst, s), c)),
                           lambda s, e: (body[s:e],))


class Float32Codec(Codec):
    """Raw float32 values (exact round trip); the reference / no-compression codec."""

    name = "fp32"
    codec_id = CODEC_IDS["fp32"]
    bits = 32.0

    def _values_nbytes(self, m: int) -> int:
        return 4 * m

    def _encode_values(self, v: Tensor, body: Tensor) -> int | None:
        dst = body.view(torch.float32)
        if paths.kernels(v) is None:
            raise_if_nonfinite_sum(v)
            dst.copy_(v)
            return None

        bad, crc = _run_elementwise("liq_f32_copy_checked", v.numel(), v, dst, body=dst)
        if any(bad):
            raise nonfinite_error(v)  # type: ignore[misc]  # a bad flag means a non-finite value
        return crc

    def _decode_values(self, body: Tensor, m: int, out: Tensor) -> int | None:
        src = body.view(torch.float32)
        if paths.kernels(body) is None:
            out.copy_(src)
            return None
        # the finiteness flag is ignored: what the payload holds is what it decodes to
        return _run_elementwise("liq_f32_copy_checked", m, src, out, body=src)[1]


class BFloat16Codec(Codec):
    """bfloat16 values (round to nearest even): relative error <= 2**-8, 2 bytes per value.

    Finite values beyond the bfloat16 range (|x| > ~3.39e38) are clamped to its largest value.
    """

    name = "bf16"
    codec_id = CODEC_IDS["bf16"]
    bits = 16.0

    def _values_nbytes(self, m: int) -> int:
        return 2 * m

    def _encode_values(self, v: Tensor, body: Tensor) -> int | None:
        y = body.view(torch.bfloat16)
        if paths.kernels(v) is not None:
            bad, crc = _run_elementwise("liq_bf16_encode", v.numel(), v, y, body=y)
            if any(bad):
                raise nonfinite_error(v)  # type: ignore[misc]
            return crc
        y.copy_(v)
        # One pass over the half-size output catches both NaN/Inf input and overflow to Inf.
        # (A plain bf16 sum accumulates in fp32 internally and is ~50x faster than sum(dtype=fp32);
        # an overflowing sum of finite values just takes the exact path below.)
        if v.numel() and not math.isfinite(float(y.sum())):
            err = nonfinite_error(v)
            if err is not None:
                raise err
            y.copy_(v.clamp(-_BF16_MAX, _BF16_MAX))
        return None

    def _decode_values(self, body: Tensor, m: int, out: Tensor) -> int | None:
        y = body.view(torch.bfloat16)
        if paths.kernels(body) is None:
            out.copy_(y)
            return None
        return _run_elementwise("liq_bf16_decode", m, y, out, body=y)[1]
