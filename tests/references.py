"""Plain reference computations the tests compare the library against (not used by the library)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_islands.engine import outer


def merge_experts(deltas: Sequence[Tensor], coefs: Sequence[Tensor]) -> Tensor:
    """Merge one whole expert parameter ``[n_experts, ...]`` with per-expert coefficients, in island order."""
    shape = deltas[0].shape
    row_numel = max(1, deltas[0].numel() // max(1, shape[0]))
    return outer.merge_expert_rows([d.reshape(-1) for d in deltas], coefs, row_numel, 0).view(shape)


def cosine(a: Tensor, b: Tensor) -> float:
    """Cosine similarity of two flat tensors (0 when either is zero)."""
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(torch.dot(a.double(), b.double())) / (na * nb)


def mean_pairwise_cosine(vectors: Sequence[Tensor]) -> float:
    """Mean cosine similarity over all pairs of islands' pseudo-gradients (1.0 for one island)."""
    pairs = [(i, j) for i in range(len(vectors)) for j in range(i + 1, len(vectors))]
    if not pairs:
        return 1.0
    return sum(cosine(vectors[i], vectors[j]) for i, j in pairs) / len(pairs)
