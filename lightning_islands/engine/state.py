"""The outer state one rank holds: its shards of the anchors, the outer momentum and the residual.

The anchors are the global parameters (fp32), the outer optimizer's momentum the same shape, and
the error-feedback residual what the codec dropped from what this island sent last round (decayed
into the next). Each is a list of tensors in parameter order, shaped like this rank's local shards,
so the strategy can save them as the module's parameters are saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_islands.engine.outer import OuterSGD


class OuterState:
    """Anchors, the outer optimizer (its momentum) and the error-feedback residual of one rank.

    Args:
        optimizer: the outer optimizer; its momentum buffers follow the anchors' order.
        device: where the state lives (``None``: where each local shard is).
    """

    def __init__(self, optimizer: OuterSGD, device: torch.device | str | None = None) -> None:
        self.optimizer = optimizer
        self.device = torch.device(device) if device else None  # None or "": where each shard is
        self.anchors: list[Tensor] = []
        self.residual: list[Tensor] | None = None

    @property
    def ready(self) -> bool:
        """Whether the anchors exist (the islands have met and agreed on the initial state)."""
        return bool(self.anchors)

    def set_anchors(self, tensors: Sequence[Tensor]) -> None:
        """Take fp32 copies of ``tensors`` (this rank's shards) as the anchors."""
        self.anchors = [t.detach().to(device=self.device or t.device, dtype=torch.float32, copy=True)
                        for t in tensors]

    @property
    def momentum(self) -> list[Tensor] | None:
        """The outer momentum per shard, or ``None`` before the first step with momentum."""
        buffers = self.optimizer.buffers
        return list(buffers) if buffers and all(b is not None for b in buffers) else None  # type: ignore[arg-type]

    def write_to(self, locals_: Sequence[Tensor]) -> None:
        """Copy the anchors into the island's local shards (cast to their dtype and device)."""
        with torch.no_grad():
            for loc, a in zip(locals_, self.anchors):
                loc.copy_(a.to(device=loc.device, dtype=loc.dtype))

    def state_dict(self) -> dict[str, Any]:
        """``anchor``, ``momentum`` (or None), ``residual`` (or None): tensor lists in parameter
        order; ``outer_steps``: the outer optimizer's step count."""
        return {"anchor": list(self.anchors), "momentum": self.momentum,
                "residual": None if self.residual is None else list(self.residual),
                "outer_steps": self.optimizer.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (copied into the existing anchors' place)."""
        if len(state["anchor"]) != len(self.anchors):
            raise ValueError(f"the saved outer state has {len(state['anchor'])} tensors but the model has "
                             f"{len(self.anchors)}; resume with the model that saved it")
        with torch.no_grad():
            for a, saved in zip(self.anchors, state["anchor"]):
                a.copy_(saved)
        momentum = state.get("momentum")
        self.optimizer.buffers = ([m.to(a.device).clone() for m, a in zip(momentum, self.anchors)]
                                  if momentum is not None else [])
        self.optimizer.steps = int(state["outer_steps"])
        residual = state.get("residual")
        self.residual = (None if residual is None
                         else [r.to(a.device).clone() for r, a in zip(residual, self.anchors)])
