"""Probe vectors for the blockwise codecs: inputs on which any deviation from the reference rounding
shows up in the bytes.

A fast kernel (on a GPU whose compiler we do not control) is trusted only after it reproduces the
torch reference path bit for bit on such a probe. Random data alone hardly ever distinguishes a
correct kernel from one that contracts ``x * inv + c`` into a fused multiply-add, approximates
``1 / scale`` by one ulp, rounds ties the wrong way or flushes subnormals: each of those changes a
handful of values in millions. So every probe holds, each in blocks of its own:

- *exact ties*: the block maximum is ``qmax * 2**-3``, so ``scale`` and ``1 / scale`` are powers of
  two and ``x * inv`` is exactly every half-integer (int codecs) or every midpoint between two
  float8_e4m3 values (fp8) in range: the tie-breaking rule decides each one;
- *rounded ties*: inputs whose product ``x * inv`` is *not* a tie but rounds in fp32 to one. Rounding
  the product first (the reference) gives the tie and its even neighbour; a fused multiply-add or an
  ``inv`` off by one ulp sees the exact product and goes the other way about half the time;
- subnormal blocks (their scales are subnormal too), near-overflow, all-zero and negative-zero blocks;
- Gaussian blocks over magnitudes 2**-60 .. 2**60.

:func:`probe` returns the whole vector, whose length is a multiple of 16 with 4-aligned block
counts (the alignment Triton specializes on for most payloads); callers also run a slice of it
that ends in a partial block and packing group.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["probe"]

_STEP = 2.0**-3
_SUBNORMAL = [1e-42, -3e-45, 1e-40, 7e-39, 0.0, -0.0]
_NEAR_OVERFLOW = [3.0e38, -3.4028234663852886e38, 1.0, -1e38, 2.5e38]
_TIE_BLOCKS = 8  # at most this many blocks of each kind of tie
_RANDOM_ELEMS = 3 * 2048  # Gaussian part: at least this many elements (and 8 blocks)


def _tie_points(qmax: float, fp8: bool) -> Tensor:
    """Positive and negative values of ``x * inv`` at which the encoder's rounding must break a tie."""
    if fp8:
        grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
        mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32: e4m3 has 3 mantissa bits
    else:
        mids = torch.arange(0, int(qmax)).float() + 0.5
    return torch.cat([mids, -mids])


def _blocks(rows: list[Tensor], block: int) -> list[Tensor]:
    """Each row zero-padded (or cut) to one block."""
    out = []
    for row in rows:
        b = torch.zeros(block)
        b[: min(block, row.numel())] = row[:block]
        out.append(b)
    return out


def _chunks(anchor: float, values: Tensor, block: int) -> list[Tensor]:
    """Blocks that each start with ``anchor`` (the block's absmax) followed by the next values."""
    per = max(1, block - 1)
    rows = [torch.cat([torch.tensor([anchor]), values[s : s + per]]) for s in range(0, values.numel(), per)]
    return _blocks(rows[:_TIE_BLOCKS], block)


def _rounded_ties(qmax: float, ties: Tensor, block: int, gen: torch.Generator) -> list[Tensor]:
    """Blocks whose entries give an ``x * inv`` that rounds (in fp32) onto a tie without being one."""
    rows = []
    for _ in range(_TIE_BLOCKS if block <= 4096 else 2):  # big blocks: two hold every tie point
        anchor = torch.rand(1, generator=gen).item() * 3 + 0.7  # not a power of two: inv is inexact
        scale = torch.tensor(anchor, dtype=torch.float32) / qmax
        inv = float(torch.reciprocal(scale))
        base = (ties.double() / inv).float()
        cand = torch.cat([base, torch.nextafter(base, base * 2), torch.nextafter(base, base * 0)])
        exact = cand.double() * inv  # exact: 24-bit times 24-bit significands
        keep = (exact.float() == torch.cat([ties] * 3)) & (exact != torch.cat([ties] * 3).double())
        keep &= cand.abs() <= anchor
        picked = cand[keep]
        picked = picked[torch.randperm(picked.numel(), generator=gen)]
        rows.append(torch.cat([torch.tensor([anchor]), picked]))
    return _blocks(rows, block)


def probe(block: int, qmax: float, fp8: bool) -> Tensor:
    """The probe vector for a blockwise codec with this block size and ``qmax`` (448 for fp8)."""
    gen = torch.Generator().manual_seed(0)
    ties = _tie_points(qmax, fp8)
    blocks = _chunks(qmax * _STEP, ties * _STEP, block)
    blocks += _rounded_ties(qmax, ties, block, gen)
    subnormals = (torch.rand(block, generator=gen) - 0.5) * 2.2e-38  # |x| < 2**-126: a subnormal scale
    blocks += _blocks([torch.tensor(_SUBNORMAL), subnormals, torch.tensor(_NEAR_OVERFLOW), torch.zeros(1),
                       torch.full((block,), -0.0)], block)
    for _ in range(max(8 if block <= 4096 else 2, -(-_RANDOM_ELEMS // block))):
        magnitude = 2.0 ** torch.randint(-60, 61, (1,), generator=gen).item()
        blocks.append(torch.randn(block, generator=gen) * magnitude)
    while len(blocks) % 4:  # 4 blocks of a multiple of 4: length and offsets multiples of 16 bytes
        blocks.append(torch.randn(block, generator=gen))
    return torch.cat(blocks)
