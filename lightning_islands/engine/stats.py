"""One round's exchange metrics, accumulated a chunk at a time.

A round may exchange the pseudo-gradient in chunks (so that an island's leader never holds the
whole vector's payloads and decoded copies at once). Norms, the quantization error and the
islands' cosine similarity are sums over elements, so each chunk adds its part and the round's
values come out as if taken over the whole vector (up to float64 rounding). Plain tensors only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

_SLAB = 1 << 20  # values per float64 temporary: the sums never copy a whole chunk to float64


def _slabs(*tensors: Tensor) -> Iterator[list[Tensor]]:
    """Matching float64 slabs of flat views of ``tensors`` (all of one length), on the first's device."""
    flat = [t.detach().reshape(-1) for t in tensors]
    for s in range(0, flat[0].numel(), _SLAB):
        yield [f[s : s + _SLAB].to(device=flat[0].device, dtype=torch.float64) for f in flat]


def _sq(t: Tensor) -> float:
    return math.fsum(float(torch.dot(a, a)) for (a,) in _slabs(t))


def _dot(a: Tensor, b: Tensor) -> float:
    return math.fsum(float(torch.dot(x, y)) for x, y in _slabs(a, b))


def _diff_sq(a: Tensor, b: Tensor) -> float:
    return math.fsum(_sq(x - y) for x, y in _slabs(a, b))


def sum_sq(tensors: Sequence[Tensor]) -> float:
    """The squared L2 norm of the concatenation of ``tensors`` (float64 sums)."""
    return math.fsum(_sq(t) for t in tensors)


class RoundStats:
    """Sums over the chunks of one round (call :meth:`add` per chunk, then :meth:`metrics`)."""

    def __init__(self, num_islands: int, delta_sq: float) -> None:
        """``delta_sq``: the squared norm of this island's pseudo-gradient, taken where its shards
        are (what the chunks carry also holds the decayed error-feedback residual)."""
        self.numel = 0
        self.payload_bytes = 0
        self.delta_sq = delta_sq
        self.sent_sq = 0.0
        self.error_sq = 0.0
        self.merged_sq = 0.0
        self.decoded_sq = [0.0] * num_islands
        self.dots = {(i, j): 0.0 for i in range(num_islands) for j in range(i + 1, num_islands)}

    def add(self, sent: Tensor, own: Tensor, payload_bytes: int, decoded: Sequence[Tensor], merged: Tensor) -> None:
        """One chunk: what this island encoded (``sent``: its pseudo-gradient plus the
        decayed error-feedback residual), its own payload decoded (``own``), the payload's size, every
        island's decoded chunk in island order, and the merged chunk."""
        self.numel += sent.numel()
        self.payload_bytes += int(payload_bytes)
        self.sent_sq += _sq(sent)
        self.error_sq += _diff_sq(sent, own)
        self.merged_sq += _sq(merged)
        for i, d in enumerate(decoded):
            self.decoded_sq[i] += _sq(d)
        for i, j in self.dots:
            self.dots[i, j] += _dot(decoded[i], decoded[j])

    def cosine(self) -> float:
        """Mean cosine similarity over all pairs of islands' decoded pseudo-gradients (1.0 for one
        island; a pair with a zero vector counts 0)."""
        if not self.dots:
            return 1.0
        total = 0.0
        for (i, j), dot in self.dots.items():
            norms = math.sqrt(self.decoded_sq[i]) * math.sqrt(self.decoded_sq[j])
            total += dot / norms if norms > 0.0 else 0.0
        return total / len(self.dots)

    def metrics(self, error_feedback: bool = False) -> dict[str, float]:
        """``islands/`` metrics of the round: pseudo-gradient norm, relative quantization error
        ``||sent - own|| / ||sent||``, compression ratio, payload bytes, merged norm; with
        ``error_feedback`` also ``residual_norm``, ``||sent - own||``: the residual the round leaves
        for the next."""
        if self.sent_sq > 0.0:
            error = math.sqrt(self.error_sq) / math.sqrt(self.sent_sq)
        else:
            error = 0.0 if self.error_sq == 0.0 else math.inf
        return {
            "islands/pseudo_grad_norm": math.sqrt(self.delta_sq),
            "islands/quant_rel_error": error,
            "islands/compression_ratio": 4.0 * self.numel / max(1, self.payload_bytes),
            "islands/payload_bytes": float(self.payload_bytes),
            "islands/merged_norm": math.sqrt(self.merged_sq),
        } | ({"islands/residual_norm": math.sqrt(self.error_sq)} if error_feedback else {})
