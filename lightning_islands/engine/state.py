"""The outer state one rank holds: its shards of the anchors, the outer momentum and the residual.

The anchors are the global parameters (fp32), the outer optimizer's momentum the same shape, and
the error-feedback residual what the codec dropped from what this island sent last round (decayed
into the next). With the butterfly topology it also keeps one *base* per stage: the global state
this island and its partners of that stage agreed on when they last mixed (what their payloads are
differences from). Each is a list of tensors in parameter order, shaped like this rank's local shards,
so the strategy can save them as the module's parameters are saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_islands.engine.outer import OuterSGD


def base_key(stage: int) -> str:
    """The state-dict key of the butterfly's base of ``stage``."""
    return f"base{stage}"


class OuterState:
    """Anchors, the outer optimizers (their momentum) and the error-feedback residual of one rank.

    Args:
        optimizer: the outer optimizer, or one per fragment (each steps its fragment's anchors and
            keeps their momentum and its own step count).
        device: where the state lives (``None``: where each local shard is).
        fragments: the parameter indices of each fragment (default: one fragment, all parameters).
        stages: the butterfly's stages (one base each; 0: no bases, the all-reduce topology).
    """

    def __init__(self, optimizer: OuterSGD | Sequence[OuterSGD], device: torch.device | str | None = None,
                 fragments: Sequence[Sequence[int]] | None = None, stages: int = 0) -> None:
        self.optimizers = [optimizer] if isinstance(optimizer, OuterSGD) else list(optimizer)
        self.fragments = [list(f) for f in fragments] if fragments is not None else None
        if len(self.optimizers) != len(self.fragments or [0]):
            raise ValueError(f"{len(self.optimizers)} outer optimizers for {len(self.fragments or [0])} fragments")
        self.device = torch.device(device) if device else None  # None or "": where each shard is
        self.anchors: list[Tensor] = []
        self.residual: list[Tensor] | None = None
        self.stages = stages
        self.bases: list[list[Tensor]] = []  # per stage, shaped like the anchors

    @property
    def optimizer(self) -> OuterSGD:
        """The outer optimizer of a state of one fragment."""
        if len(self.optimizers) != 1:
            raise AttributeError("a state of several fragments has one outer optimizer per fragment (optimizers)")
        return self.optimizers[0]

    @property
    def ready(self) -> bool:
        """Whether the anchors exist (the islands have met and agreed on the initial state)."""
        return bool(self.anchors)

    def indices(self, fragment: int) -> list[int]:
        """The parameter indices of ``fragment``."""
        return self.fragments[fragment] if self.fragments is not None else list(range(len(self.anchors)))

    def set_anchors(self, tensors: Sequence[Tensor]) -> None:
        """Take fp32 copies of ``tensors`` (this rank's shards) as the anchors."""
        self.anchors = [t.detach().to(device=self.device or t.device, dtype=torch.float32, copy=True)
                        for t in tensors]
        self.bases = [[a.clone() for a in self.anchors] for _ in range(self.stages)]

    def step(self, fragment: int, grads: Sequence[Tensor]) -> OuterSGD:
        """The outer step of ``fragment``'s anchors from their merged pseudo-gradients; returns its optimizer."""
        opt = self.optimizers[fragment]
        opt.step([self.anchors[i] for i in self.indices(fragment)], grads)
        return opt

    @property
    def momentum(self) -> list[Tensor] | None:
        """The outer momentum per shard, or ``None`` before any fragment's first step with momentum
        (a fragment that has not stepped yet holds zeros meanwhile)."""
        if not any(b is not None for opt in self.optimizers for b in opt.buffers):
            return None
        out: list[Tensor | None] = [None] * len(self.anchors)
        for f, opt in enumerate(self.optimizers):
            for i, buf in zip(self.indices(f), opt.buffers or [None] * len(self.indices(f))):
                out[i] = buf
        if any(b is None for b in out) and len(self.optimizers) == 1:
            return None
        return [b if b is not None else torch.zeros_like(a) for b, a in zip(out, self.anchors)]

    def write_to(self, locals_: Sequence[Tensor], indices: Sequence[int] | None = None, alpha: float = 0.0) -> None:
        """Copy the anchors (of parameters ``indices``, default all) into the island's local shards
        (cast to their dtype and device); ``alpha > 0`` keeps that share of the local parameters'
        distance from the anchors: ``anchor + alpha * (local - anchor)``."""
        with torch.no_grad():
            for i in range(len(self.anchors)) if indices is None else indices:
                loc, a = locals_[i], self.anchors[i]
                if alpha:
                    a = torch.lerp(a, loc.to(a.device, a.dtype), alpha)
                loc.copy_(a.to(device=loc.device, dtype=loc.dtype))

    def steps(self) -> int | list[int]:
        """The outer step count: one int, or one per fragment."""
        counts = [opt.steps for opt in self.optimizers]
        return counts[0] if len(counts) == 1 else counts

    def state_dict(self) -> dict[str, Any]:
        """``anchor``, ``momentum`` (or None), ``residual`` (or None), with the butterfly ``base0``
        .. (one per stage): tensor lists in parameter order; ``outer_steps``: the outer step count (a
        list, one per fragment, with fragments)."""
        return {"anchor": list(self.anchors), "momentum": self.momentum,
                "residual": None if self.residual is None else list(self.residual),
                "outer_steps": self.steps(), **{base_key(k): list(b) for k, b in enumerate(self.bases)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (copied into the existing anchors' place)."""
        if len(state["anchor"]) != len(self.anchors):
            raise ValueError(f"the saved outer state has {len(state['anchor'])} tensors but the model has "
                             f"{len(self.anchors)}; resume with the model that saved it")
        steps = state["outer_steps"]
        steps = [int(steps)] if isinstance(steps, int) else [int(s) for s in steps]
        if len(steps) != len(self.optimizers):
            raise ValueError(f"the saved outer state has {len(steps)} fragments but this run has "
                             f"{len(self.optimizers)}; resume with the islands.fragments it was saved with")
        with torch.no_grad():
            for a, saved in zip(self.anchors, state["anchor"]):
                a.copy_(saved)
        momentum = state.get("momentum")
        for f, opt in enumerate(self.optimizers):
            opt.steps = steps[f]
            # a fragment that has not stepped has no momentum yet (saved as zeros beside the others)
            opt.buffers = ([momentum[i].to(self.anchors[i].device).clone() for i in self.indices(f)]
                           if momentum is not None and steps[f] > 0 else [])
        for k, base in enumerate(self.bases):  # a state saved without bases (all-reduce): the anchors
            for b, saved in zip(base, state.get(base_key(k)) or state["anchor"]):
                b.copy_(saved)
        residual = state.get("residual")
        self.residual = (None if residual is None
                         else [r.to(a.device).clone() for r, a in zip(residual, self.anchors)])
