"""How many tokens a batch holds: the merge weight an island counts for each of its batches."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import Tensor


def batch_weight(module: pl.LightningModule, batch: Any) -> int:
    """Tokens in ``batch``: the module's ``tokens_per_batch(batch)`` if it has one, else the number
    of elements of the first tensor found (for ``(B, T)`` token ids: tokens; for other inputs: the
    leading dimension)."""
    fn = getattr(module, "tokens_per_batch", None)
    if callable(fn):
        return int(fn(batch))
    stack = [batch]
    while stack:
        item = stack.pop(0)
        if isinstance(item, Tensor):
            return int(item.numel()) if item.dim() <= 2 else int(item.shape[0])
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return 1
