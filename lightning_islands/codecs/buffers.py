"""Scratch tensors reused by name, for a loop that needs the same temporaries on every pass.

A round's exchange walks the model a chunk at a time and needs the same few chunk-sized tensors for
every chunk (the payload, the decoded copies, the merge). Allocated afresh, each large one is a new
mapping whose every page faults on first touch (on the 2-vCPU VM of docs/BENCHMARKS.md, that doubled
the leader's time per chunk at 64 MiB chunks); taken from a :class:`Buffers`, the first chunk pays
and the others reuse. Drop the object when the loop ends and the memory goes with it.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Buffers:
    """Named scratch tensors: :meth:`take` returns the first ``numel`` values of the named buffer,
    allocating (or growing) it only when it is too small or of another dtype or device. A taken
    tensor is valid until the same name is taken again."""

    def __init__(self) -> None:
        self._held: dict[str, Tensor] = {}

    def take(self, name: str, numel: int, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> Tensor:
        """A contiguous 1-D tensor of ``numel`` values (contents unspecified)."""
        device = torch.device(device)
        held = self._held.get(name)
        if held is None or held.numel() < numel or held.dtype != dtype or held.device != device:
            self._held.pop(name, None)  # free the old one before allocating its successor
            held = self._held[name] = torch.empty(numel, dtype=dtype, device=device)
        return held[:numel]

    def clear(self) -> None:
        """Drop every buffer (tensors taken from them keep their own memory alive)."""
        self._held.clear()

