"""Element-wise codecs without blocks: raw fp32 and bfloat16."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_islands.codecs.base import Codec, nonfinite_error, raise_if_nonfinite_sum
from lightning_islands.codecs.wire import CODEC_IDS

_BF16_MAX = torch.finfo(torch.bfloat16).max


class Float32Codec(Codec):
    """Raw float32 values (exact round trip); the reference / no-compression codec."""

    name = "fp32"
    codec_id = CODEC_IDS["fp32"]
    bits = 32.0

    def _values_nbytes(self, m: int) -> int:
        return 4 * m

    def _encode_values(self, v: Tensor, body: Tensor) -> None:
        raise_if_nonfinite_sum(v)
        body.view(torch.float32).copy_(v)

    def _decode_values(self, body: Tensor, m: int, out: Tensor) -> None:
        out.copy_(body.view(torch.float32))  # what the payload holds is what it decodes to, finite or not


class BFloat16Codec(Codec):
    """bfloat16 values (round to nearest even): relative error <= 2**-8, 2 bytes per value.

    Finite values beyond the bfloat16 range (|x| > ~3.39e38) are clamped to its largest value.
    """

    name = "bf16"
    codec_id = CODEC_IDS["bf16"]
    bits = 16.0

    def _values_nbytes(self, m: int) -> int:
        return 2 * m

    def _encode_values(self, v: Tensor, body: Tensor) -> None:
        y = body.view(torch.bfloat16)
        y.copy_(v)
        # One pass over the half-size output catches both NaN/Inf input and overflow to Inf.
        # (A plain bf16 sum accumulates in fp32 internally and is ~50x faster than sum(dtype=fp32);
        # an overflowing sum of finite values just takes the exact path below.)
        if v.numel() and not math.isfinite(float(y.sum())):
            err = nonfinite_error(v)
            if err is not None:
                raise err
            y.copy_(v.clamp(-_BF16_MAX, _BF16_MAX))

    def _decode_values(self, body: Tensor, m: int, out: Tensor) -> None:
        out.copy_(body.view(torch.bfloat16))
