"""Top-k sparsification: the kept values through an inner codec, their indices Elias-Fano coded."""

from __future__ import annotations

from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor

from lightning_islands import native
from lightning_islands.buffers import Buffers, take
from lightning_islands.codecs import paths
from lightning_islands.codecs.base import Codec, raise_if_nonfinite_sum
from lightning_islands.codecs.checksum import crc_piece
from lightning_islands.codecs.dense import Float32Codec
from lightning_islands.codecs.elias_fano import ef_decode, ef_encode, ef_layout
from lightning_islands.codecs.selection import NATIVE_TOPK_MAX, magnitude_bits, native_topk, topk_indices
from lightning_islands.codecs.wire import KIND_TOPK, ceil_div
from lightning_islands.crc32 import crc32_combine


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

    def _encode_body(self, x: Tensor, body: Tensor, scratch: Buffers | None = None) -> int | None:
        n = x.numel()
        k = self._count(n)
        lib = paths.kernels(x)
        if k < n and lib is not None and n <= NATIVE_TOPK_MAX:
            idx, values = native_topk(x, k, scratch)  # refuses NaN/Inf in its first pass
        elif k == n:
            raise_if_nonfinite_sum(x)
            idx = torch.arange(n, dtype=torch.int64, device=x.device)
            values = x
        else:
            raise_if_nonfinite_sum(x)
            idx = topk_indices(magnitude_bits(x), k)
            values = x.index_select(0, idx)
        inner_bytes = self.inner._values_nbytes(k)
        inner_crc = self.inner._encode_values(values, body[:inner_bytes]) if k else None
        ef_encode(idx, n, body[inner_bytes:])
        if inner_crc is None:
            return None
        ef_crc, ef_bytes = crc_piece(body[inner_bytes:])  # the index part is small: the values took the pass
        return crc32_combine(inner_crc, ef_crc, ef_bytes)

    def _checksums_while_decoding(self, body: Tensor) -> bool:
        return False  # the body is index-decoded first: verify it before trusting its indices

    def _decode_body(self, body: Tensor, n: int, k: int, out: Tensor, scratch: Buffers | None = None) -> None:
        inner_bytes = self.inner._values_nbytes(k)
        values = take(scratch, "topk.values", k, device=body.device)
        if k:
            self.inner._decode_values(body[:inner_bytes], k, values)
        idx = ef_decode(body[inner_bytes:], n, k, scratch)
        if k == n:
            out.copy_(values)
            return
        lib = paths.kernels(out)
        if lib is None:
            out.zero_()
            out.index_copy_(0, idx, values)  # unique indices: deterministic
            return
        ranges = native.split(n, 1)
        cuts = torch.searchsorted(idx, torch.tensor([s for s, _ in ranges] + [n])).tolist()
        native.run_jobs([("liq_topk_scatter", (native.ptr(idx, cuts[r]), native.ptr(values, cuts[r]),
                                               cuts[r + 1] - cuts[r], s, e, native.ptr(out)))
                         for r, (s, e) in enumerate(ranges)])

    def spec(self) -> dict[str, Any]:
        """Wire-format description including the top-k fraction and index encoding."""
        d = super().spec()
        d.update(
            k_fraction=_fmt_fraction(self.fraction),
            index_encoding="elias-fano",
            inner=self.inner.name,
        )
        return d
