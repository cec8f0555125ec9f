"""Top-k sparsification: the kept values through an inner codec, their indices Elias-Fano coded."""

from __future__ import annotations

from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor

from lightning_islands.codecs.base import Codec, raise_if_nonfinite_sum
from lightning_islands.codecs.buffers import Buffers
from lightning_islands.codecs.dense import Float32Codec
from lightning_islands.codecs.elias_fano import ef_decode, ef_encode, ef_layout
from lightning_islands.codecs.selection import magnitude_bits, topk_indices
from lightning_islands.codecs.wire import KIND_TOPK, ceil_div


def _fmt_fraction(f: Fraction) -> str:
    with localcontext() as ctx:
        ctx.prec = 60
        text = format((Decimal(f.numerator) / Decimal(f.denominator)).normalize(), "f")
    return text


class TopKCodec(Codec):
    """Keep the ``ceil(fraction * n)`` largest-magnitude entries; values via an inner codec.

    Indices travel Elias-Fano coded (see :mod:`lightning_islands.codecs.wire`); values in increasing index
    order, encoded by ``inner`` (fp32 by default) without its own header. Ties at the k-th
    largest magnitude go to the lowest indices, so the kept set (and the payload) is the same
    on every device and path.
    """

    kind = KIND_TOPK

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

    @property
    def alignment(self) -> int:
        """The quantizer's (see :attr:`Codec.alignment`)."""
        return self.inner.alignment

    def _count(self, n: int) -> int:
        return min(n, ceil_div(n * self.fraction.numerator, self.fraction.denominator))

    def _body_nbytes(self, n: int) -> int:
        k = self._count(n)
        _, low_bytes, high_bytes = ef_layout(n, k)
        return self.inner._values_nbytes(k) + low_bytes + high_bytes

    def _encode_body(self, x: Tensor, body: Tensor, scratch: Buffers) -> None:
        n = x.numel()
        k = self._count(n)
        raise_if_nonfinite_sum(x)
        if k == n:
            idx = torch.arange(n, dtype=torch.int64, device=x.device)
            values = x
        else:
            idx = topk_indices(magnitude_bits(x), k)
            values = x.index_select(0, idx)
        inner_bytes = self.inner._values_nbytes(k)
        if k:
            self.inner._encode_values(values, body[:inner_bytes])
        ef_encode(idx, n, body[inner_bytes:])

    def _decode_body(self, body: Tensor, n: int, k: int, out: Tensor, scratch: Buffers) -> None:
        inner_bytes = self.inner._values_nbytes(k)
        values = scratch.take("topk.values", k, device=body.device)
        if k:
            self.inner._decode_values(body[:inner_bytes], k, values)
        idx = ef_decode(body[inner_bytes:], n, k)
        if k == n:
            out.copy_(values)
            return
        out.zero_()
        out.index_copy_(0, idx, values)  # unique indices: deterministic

    def spec(self) -> dict[str, Any]:
        """Wire-format description including the top-k fraction and index encoding."""
        d = super().spec()
        d.update(
            k_fraction=_fmt_fraction(self.fraction),
            index_encoding="elias-fano",
            inner=self.inner.name,
        )
        return d
