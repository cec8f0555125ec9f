"""The sign codec: one bit per value and the block's mean magnitude as its scale."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_islands.codecs.blockwise import BlockCodec
from lightning_islands.codecs.buffers import Buffers
from lightning_islands.codecs.packing import pack_planar, unpack_planar
from lightning_islands.codecs.wire import CODEC_IDS, DEFAULT_BLOCK_SIZE, block_pieces


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
    same on every device for any scale bits a payload may carry.
    """
    o = out.view(torch.int32)
    o.copy_(bits).bitwise_left_shift_(31)  # 1 -> 0x80000000, 0 -> 0
    sb = scale.view(torch.int32)
    for s, e, rows, b in block_pieces(out.numel(), block):
        o[s:e].view(rows, -1).bitwise_xor_(sb[b : b + rows].unsqueeze(1))


class SignCodec(BlockCodec):
    """One bit per value: its sign, with one fp32 scale per block = the block's mean ``|x|``.

    Decode is ``+scale`` or ``-scale`` (``-0.0`` counts as negative; the sign bit of the scale is
    flipped, so decoding involves no arithmetic). For a sign code the block mean
    of ``|x|`` is the magnitude with the least squared error, so on Gaussian-like blocks the
    relative L2 error is about ``sqrt(1 - 2/pi) = 0.60``, below int2's ~0.77 (whose absmax scale
    rounds most values of a block to zero) at half the value bits: 1.25 bits per value at block
    128 (25.6x smaller than fp32). Meant for frequent exchanges with error feedback (on by default).
    """

    codec_id = CODEC_IDS["sign"]
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
        unit = self.alignment
        return max(1, (1 << 24) // unit) * unit

    def _encode_slab(self, x: Tensor, scale: Tensor, values: Tensor, work: Buffers) -> None:
        count = x.numel()
        for s, e, rows, b in block_pieces(count, self.block_size):
            _mean_abs_rows(x[s:e].view(rows, -1), scale[b : b + rows], self._span)
        q = work.take("codes", count, torch.uint8, x.device)
        torch.signbit(x, out=q.view(torch.bool))
        pack_planar(q, values, self.pack)

    def _decode_slab(self, values: Tensor, scale: Tensor, out: Tensor, work: Buffers) -> None:
        q = work.take("codes", out.numel(), torch.uint8, out.device)
        unpack_planar(values, q, self.pack)
        _sign_flip(out, q, scale, self.block_size)  # no rounding at all
