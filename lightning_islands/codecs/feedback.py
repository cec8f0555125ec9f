"""Error feedback (an island's quantization residual, carried into its next round) and metrics."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


class ErrorFeedback:
    """Carries the quantization residual of one island into its next pseudo-gradient.

    Usage per outer step::

        c = ef.compensate(pseudo_grad)      # pseudo_grad + decay * residual
        payload = codec.encode(c)
        mine = codec.decode(payload)        # what the other islands will see from us
        ef.update(c, mine)                  # residual = c - mine

    With ``decay`` 1 (plain error feedback), over many rounds the running sum of what was
    transmitted tracks the running sum of the true pseudo-gradients to within one round's
    quantization error instead of drifting. ``decay`` in [0, 1) carries only that share of the
    residual into the next round (see :func:`with_residual`), so the rest of what the codec held
    back is dropped for good, each round; 0 is the same as no error feedback.
    """

    def __init__(self, decay: float = 1.0) -> None:
        self.decay = check_decay(decay)
        self.residual: Tensor | None = None

    def compensate(self, x: Tensor) -> Tensor:
        """``x + decay * residual`` (a new tensor); ``x`` itself while there is no residual yet."""
        if self.residual is None:
            return x
        if self.residual.shape != x.shape:
            raise ValueError(
                f"error-feedback residual has shape {tuple(self.residual.shape)} but the pseudo-gradient "
                f"has shape {tuple(x.shape)}; call reset() after changing the model"
            )
        return with_residual(x, self.residual.to(device=x.device, dtype=x.dtype), self.decay)

    def update(self, compensated: Tensor, decoded: Tensor) -> None:
        """Store ``compensated - decoded`` as the residual for the next round."""
        if compensated.shape != decoded.shape:
            raise ValueError(
                f"shape mismatch: compensated {tuple(compensated.shape)} vs decoded {tuple(decoded.shape)}"
            )
        if (
            self.residual is not None
            and self.residual.shape == compensated.shape
            and self.residual.device == compensated.device
            and self.residual.dtype == compensated.dtype
            and self.residual.data_ptr() not in (compensated.data_ptr(), decoded.data_ptr())
        ):
            torch.sub(compensated, decoded, out=self.residual)
        else:
            self.residual = compensated - decoded

    def reset(self) -> None:
        """Drop the residual (e.g. after a model change or a divergence restart)."""
        self.residual = None

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: ``{"residual": Tensor | None}``, on the CPU (so a checkpoint taken on
        a GPU loads anywhere; :meth:`compensate` moves the residual to the data's device)."""
        return {"residual": None if self.residual is None else self.residual.detach().to("cpu", copy=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state produced by :meth:`state_dict`."""
        if "residual" not in state:
            raise ValueError(f"error-feedback state must contain 'residual', got keys {sorted(state)}")
        residual = state["residual"]
        if residual is not None and not isinstance(residual, Tensor):
            raise TypeError(f"residual must be a Tensor or None, got {type(residual).__name__}")
        self.residual = None if residual is None else residual.detach().clone()


def check_decay(decay: float, name: str = "error-feedback decay") -> float:
    """``decay`` as a float, or a ``ValueError`` naming the setting (``name``) and the range if it is
    outside [0, 1]."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"{name} must be in [0, 1] (the share of the residual kept from round to round), "
                         f"got {decay}")
    return float(decay)


def add_residual_(x: Tensor, residual: Tensor, decay: float = 1.0) -> Tensor:
    """:func:`with_residual` in place of ``x`` (the same values, bit for bit, without a new tensor:
    for an ``x`` the caller owns, such as a round's fresh pseudo-gradient)."""
    return x.add_(residual) if decay == 1.0 else x.add_(residual, alpha=decay)


def with_residual(x: Tensor, residual: Tensor, decay: float = 1.0) -> Tensor:
    """What a round sends with error feedback: ``x + decay * residual`` (a new tensor).

    ``decay`` 1 adds the whole residual (bit for bit ``x + residual``); below 1, what the codec held
    back for k rounds reaches the wire scaled by ``decay ** k``, so updates from many rounds ago fade
    instead of arriving after the model has moved on. 0 sends ``x`` alone.
    """
    if decay == 1.0:
        return torch.add(x, residual)
    return torch.add(x, residual, alpha=decay)


def quantization_error(x: Tensor, decoded: Tensor) -> float:
    """Relative L2 error ``||x - decoded|| / ||x||`` (in float64); 0.0 when x is all zeros."""
    if x.shape != decoded.shape:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs {tuple(decoded.shape)}")
    xd = x.detach().to(torch.float64)
    norm = float(torch.linalg.vector_norm(xd))
    diff = float(torch.linalg.vector_norm(xd - decoded.detach().to(device=x.device, dtype=torch.float64)))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def compression_ratio(n: int, payload_bytes: int) -> float:
    """fp32 size over payload size: ``4 * n / payload_bytes``."""
    if payload_bytes <= 0:
        raise ValueError(f"payload_bytes must be positive, got {payload_bytes}")
    return 4.0 * n / payload_bytes
