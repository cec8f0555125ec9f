"""The outer step of DiLoCo on plain tensors: pseudo-gradients, their merge, and outer SGD.

Nothing here knows about Lightning, processes or sockets. Every function works on the tensors it is
given, and every elementwise operation is a single IEEE operation (one multiply, or one add) in its
own kernel. A fused multiply-add would round once instead of twice, and whether a kernel fuses can
depend on where a shard's boundary falls inside a SIMD vector; with single operations the result of
each element depends only on its inputs, so islands that shard the same parameters differently
(or run on different devices) still compute bit-identical global state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def pseudo_gradient(anchor: Tensor, local: Tensor) -> Tensor:
    """``anchor - local`` in fp32: the direction the island moved away from the global parameters."""
    return torch.sub(anchor, local.to(anchor.dtype))


def merge_weights(weights: Sequence[float]) -> list[float]:
    """Normalised merge coefficients; equal weights when every island reports zero."""
    if any(w < 0 or not math.isfinite(w) for w in weights):
        raise ValueError(f"merge weights must be finite and non-negative, got {list(weights)}")
    total = math.fsum(weights)
    if total == 0.0:
        return [1.0 / len(weights)] * len(weights)
    return [w / total for w in weights]


def merge_members(norms: Sequence[float | None], ratio: float | None) -> list[int]:
    """The islands whose pseudo-gradients enter the merge, from each island's pseudo-gradient norm
    (``None``: not finite, NaN or inf somewhere): every finite one, except, with ``ratio``, those
    more than ``ratio`` times the (lower) median of the positive finite norms. Every island
    computes the same list from the same round headers."""
    finite = [i for i, n in enumerate(norms) if n is not None and math.isfinite(n)]
    positive = sorted(float(norms[i]) for i in finite if norms[i])  # type: ignore[arg-type]
    if not ratio or not positive:
        return finite
    limit = ratio * positive[(len(positive) - 1) // 2]
    return [i for i in finite if float(norms[i]) <= limit]  # type: ignore[arg-type]


def merge(deltas: Sequence[Tensor], weights: Sequence[float], out: Tensor | None = None,
          scratch: Tensor | None = None) -> Tensor:
    """Weighted average of the islands' pseudo-gradients (one weight per island), in island order.

    ``out`` and ``scratch`` (optional, shaped like the deltas): where to write the result and each
    later island's weighted term, instead of new tensors; the same operations, so the same values.
    """
    if not deltas:
        raise ValueError("merge needs at least one pseudo-gradient")
    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} pseudo-gradients but {len(weights)} weights")
    result: Tensor | None = None
    for delta, coef in zip(deltas, merge_weights([float(w) for w in weights])):
        c = torch.tensor(coef, dtype=delta.dtype, device=delta.device)
        if result is None:
            result = torch.mul(delta, c) if out is None else torch.mul(delta, c, out=out)
        else:
            result.add_(torch.mul(delta, c) if scratch is None else torch.mul(delta, c, out=scratch))
    assert result is not None
    return result


def expert_coefficients(counts: Sequence[Sequence[float]]) -> list[Tensor]:
    """Per-expert merge coefficients from each island's tokens routed to each expert.

    ``counts[i][e]`` is island ``i``'s token count for expert ``e``; an expert that no island
    routed a token to falls back to equal shares. Returns one fp32 tensor ``[n_experts]`` per island.
    """
    return [c.to(torch.float32) for c in _expert_shares(counts)[0]]


def _expert_shares(counts: Sequence[Sequence[float]]) -> tuple[Tensor, Tensor]:
    """:func:`expert_coefficients` in fp64, ``[islands, experts]``, and each expert's tokens over
    all islands, ``[experts]``."""
    rows = torch.tensor([list(c) for c in counts], dtype=torch.float64)
    if (rows < 0).any() or not torch.isfinite(rows).all():
        raise ValueError("expert token counts must be finite and non-negative")
    total = rows.sum(dim=0)
    shares = torch.where(total > 0, rows / torch.where(total > 0, total, torch.ones_like(total)),
                         torch.full_like(rows, 1.0 / rows.shape[0]))
    return shares, total


def expert_share_gap(counts: Sequence[Sequence[float]], weights: Sequence[float]) -> tuple[float, float]:
    """How far expert-aware weighting moves one expert parameter's merge from token weighting.

    ``counts[i][e]``: island ``i``'s tokens routed to expert ``e``; ``weights[i]``: its tokens in
    all. Each island's coefficient for expert ``e`` (:func:`expert_coefficients`) is compared with
    its token share (:func:`merge_weights`). Returns the largest difference over islands and experts,
    and the mean difference weighted by each expert's tokens (0 when nobody routed a token): 0 means
    expert weighting merges exactly as token weighting does.
    """
    coefs, routed = _expert_shares(counts)
    shares = torch.tensor(merge_weights(weights), dtype=torch.float64).unsqueeze(1)
    per_expert = (coefs - shares).abs().max(dim=0).values  # the largest over islands
    total = float(routed.sum())
    mean = float((per_expert * routed).sum()) / total if total > 0 else 0.0
    return float(per_expert.max()), mean


def merge_expert_rows(deltas: Sequence[Tensor], coefs: Sequence[Tensor], row_numel: int, first: int) -> Tensor:
    """Merge a flat slice of one expert parameter ``[n_experts, ...]`` with per-expert coefficients,
    in island order: element ``first + j`` of the flattened parameter belongs to expert row
    ``(first + j) // row_numel``, so a chunk of the flat vector merges exactly as the whole
    parameter would."""
    if row_numel < 1:
        raise ValueError(f"row_numel must be >= 1, got {row_numel}")
    n = deltas[0].numel()
    rows = torch.arange(first, first + n, device=deltas[0].device) // row_numel
    out: Tensor | None = None
    for delta, c in zip(deltas, coefs):
        term = torch.mul(delta, c.to(delta.device)[rows])
        out = term if out is None else out.add_(term)
    assert out is not None
    return out


def exchange_chunk_numel(mib: float | None, unit: int) -> int | None:
    """Values of the flat vector exchanged at a time for a chunk of ``mib`` MiB of fp32, rounded
    down to a multiple of ``unit`` (at least one unit); ``None`` (one chunk, the whole vector)
    for ``mib`` None or 0."""
    if mib is None or mib == 0:
        return None
    if mib < 0 or not math.isfinite(mib) or unit < 1:
        raise ValueError(f"the exchange chunk must be a positive size in MiB (or 0 for the whole vector), got {mib}")
    return max(unit, int(mib * (1 << 18)) // unit * unit)


def chunk_bounds(numel: int, chunk: int | None) -> list[tuple[int, int]]:
    """``[start, stop)`` of each chunk of a flat vector of ``numel`` values, in order: one range
    for ``chunk`` None (or at least ``numel``)."""
    if chunk is None or chunk >= numel:
        return [(0, numel)]
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return [(s, min(s + chunk, numel)) for s in range(0, numel, chunk)]


class OuterSGD:
    """``torch.optim.SGD`` semantics (momentum, dampening, Nesterov, weight decay) on tensor lists.

    Call :meth:`step` with the parameters (anchors) and their pseudo-gradients in the same order
    every time; momentum buffers are kept per position. ``lr=1, momentum=0`` is plain averaging.

    ``lr_warmup`` and ``momentum_warmup`` (outer steps, 0: off) ramp the learning rate and the
    momentum linearly: step ``t`` (counted from 1) uses ``lr * min(1, t / lr_warmup)`` and
    ``momentum * min(1, t / momentum_warmup)``. The step count is part of :meth:`state_dict`, so a
    resumed run continues the ramp where it stopped.
    """

    def __init__(
        self,
        lr: float = 0.7,
        momentum: float = 0.9,
        nesterov: bool = True,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        lr_warmup: int = 0,
        momentum_warmup: int = 0,
    ) -> None:
        if lr <= 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"outer optimizer needs lr > 0, momentum >= 0, weight_decay >= 0 "
                             f"(got lr={lr}, momentum={momentum}, weight_decay={weight_decay})")
        if lr_warmup < 0 or momentum_warmup < 0:
            raise ValueError(f"outer warm-ups are counted in outer steps and must be >= 0 (0: no warm-up), "
                             f"got lr_warmup={lr_warmup}, momentum_warmup={momentum_warmup}")
        if momentum_warmup and not momentum:
            raise ValueError("momentum_warmup ramps the outer momentum, but momentum is 0: set a momentum "
                             "or drop the warm-up")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires momentum > 0 and dampening = 0 (as in torch.optim.SGD)")
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.dampening = dampening
        self.weight_decay = weight_decay
        self.lr_warmup = int(lr_warmup)
        self.momentum_warmup = int(momentum_warmup)
        self.buffers: list[Tensor | None] = []
        self.steps = 0

    def lr_at(self, step: int) -> float:
        """The learning rate of outer step ``step`` (counted from 1)."""
        return self.lr * _ramp(step, self.lr_warmup)

    def momentum_at(self, step: int) -> float:
        """The momentum of outer step ``step`` (counted from 1)."""
        return self.momentum * _ramp(step, self.momentum_warmup)

    @torch.no_grad()
    def step(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
        """Update ``params`` in place from ``grads``."""
        if len(params) != len(grads):
            raise ValueError(f"{len(params)} parameters but {len(grads)} pseudo-gradients")
        if not self.buffers:
            self.buffers = [None] * len(params)
        lr, momentum = self.lr_at(self.steps + 1), self.momentum_at(self.steps + 1)
        for i, (p, g) in enumerate(zip(params, grads)):
            d = g
            if self.weight_decay:
                d = torch.add(d, torch.mul(p, self.weight_decay))
            if momentum:
                buf = self.buffers[i]
                if buf is None:
                    buf = d.clone()
                    self.buffers[i] = buf
                else:
                    buf.mul_(momentum)
                    buf.add_(d if self.dampening == 0 else torch.mul(d, 1.0 - self.dampening))
                d = torch.add(d, torch.mul(buf, momentum)) if self.nesterov else buf
            p.sub_(torch.mul(d, lr))
        self.steps += 1

    def settings(self) -> dict[str, float | bool]:
        """The hyper-parameters, for fingerprints and logs."""
        return {"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov,
                "dampening": self.dampening, "weight_decay": self.weight_decay,
                "lr_warmup": self.lr_warmup, "momentum_warmup": self.momentum_warmup}

    def state_dict(self) -> dict:
        """Momentum buffers (``None`` before the first step) and the step count."""
        return {"buffers": list(self.buffers), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.buffers = list(state["buffers"])
        self.steps = int(state["steps"])


def _ramp(step: int, warmup: int) -> float:
    """Linear warm-up factor of step ``step`` (from 1) over ``warmup`` steps: 1 once it is done."""
    return 1.0 if warmup <= 0 or step >= warmup else step / warmup

