"""The probe that a fast codec kernel must reproduce bit for bit before it is trusted: it must tell the
reference rounding apart from the ways a GPU compiler could get it wrong."""

from __future__ import annotations

import pytest
import torch

from lightning_islands.codecs.probe import probe

_FMAX = torch.finfo(torch.float32).max


def _e4m3_of_exact(d: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn rounding (nearest, ties to even) of float64 values, in one step (torch's own
    float64 -> float8 cast goes through float32, i.e. rounds twice)."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # ascending
    a = d.abs().clamp(max=448.0)
    hi = torch.searchsorted(grid, a).clamp(1, grid.numel() - 1)
    lo = hi - 1
    below, above = a - grid[lo], grid[hi] - a
    pick = torch.where(below < above, lo, torch.where(above < below, hi, torch.where(lo % 2 == 0, lo, hi)))
    pick = torch.where(a == grid[hi], hi, pick)
    return (torch.sign(d) * grid[pick]).float()


def _codes(x: torch.Tensor, block: int, qmax: float, fp8: bool, fault: str) -> torch.Tensor:
    """The quantized values of x (as floats) under the reference rule, or under one fault."""
    blocks = x.view(-1, block)
    scale = blocks.abs().amax(1) / qmax
    inv = torch.reciprocal(scale).clamp(max=_FMAX)
    if fault == "inv_one_ulp":  # an approximate reciprocal
        inv = torch.nextafter(inv, torch.full_like(inv, _FMAX))
    if fault == "fma":  # x * inv + rounding constant contracted: the exact product is rounded once
        exact = blocks.double() * inv.double()[:, None]
        return _e4m3_of_exact(exact) if fp8 else torch.round(exact)
    t = blocks * inv[:, None]
    if fault == "flush_subnormals":
        t = torch.where(t.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(t), t)
        blocks_flushed = torch.where(blocks.abs() < torch.finfo(torch.float32).tiny, 0.0, blocks)
        t = blocks_flushed * inv[:, None]
    if fp8:
        return t.to(torch.float8_e4m3fn).float()
    if fault == "ties_away":
        return torch.sign(t) * torch.floor(t.abs() + 0.5)
    return torch.round(t)


@pytest.mark.parametrize("block", [4, 36, 128, 4096])
@pytest.mark.parametrize("qmax, fp8", [(127.0, False), (7.0, False), (1.0, False), (448.0, True)])
def test_the_probe_catches_each_rounding_fault(block, qmax, fp8):
    x = probe(block, qmax, fp8)
    reference = _codes(x, block, qmax, fp8, "none")
    faults = ["fma", "inv_one_ulp", "flush_subnormals"] + ([] if fp8 else ["ties_away"])
    missed = [f for f in faults if torch.equal(_codes(x, block, qmax, fp8, f), reference)]
    assert not missed, f"the probe does not tell {missed} from the reference rounding"


@pytest.mark.parametrize("block", [4, 36, 128, 4096, 1 << 20])
def test_the_probe_has_its_special_blocks_and_alignment_at_every_block_size(block):
    x = probe(block, 7.0, False)
    assert x.numel() % (4 * block) == 0 and x.numel() % 16 == 0
    absmax = x.view(-1, block).abs().amax(1)
    assert (absmax == 0).any(), "an all-zero block"
    assert (absmax > 1e38).any(), "a near-overflow block"
    assert ((absmax > 0) & (absmax < 1e-37)).any(), "a subnormal block"
    assert torch.isfinite(x).all()
    assert torch.equal(probe(block, 7.0, False), x), "deterministic"
