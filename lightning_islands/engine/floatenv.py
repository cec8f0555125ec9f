"""Whether a device keeps IEEE subnormal floats: part of what islands must share to stay bit-identical.

Every island decodes the same payloads, merges them and takes the same outer step, and gets the
same bits only if its arithmetic rounds the same way. A process that flushes subnormal results to
zero (``torch.set_flush_denormal(True)``, or a library that sets the CPU's FTZ/DAZ modes) computes
``q * scale`` or ``anchor - lr * d`` differently wherever a result falls below ``2**-126``, so
islands in different modes drift apart without any error. The probe here lets islands compare
their modes at rendezvous, where a difference is still a clear error instead of a silent drift.
"""

from __future__ import annotations

import torch

_SUBNORMAL = 2.0**-140  # an fp32 subnormal: above 2**-149, below 2**-126
KEPT = "kept"
FLUSHED = "flushed to zero (torch.set_flush_denormal(True), or a library setting FTZ/DAZ?)"


def flushes_subnormals(device: torch.device | str) -> bool:
    """Whether fp32 arithmetic on ``device`` (on the CPU: in the calling thread) flushes subnormal
    inputs or results to zero."""
    tiny = torch.full((1,), _SUBNORMAL, dtype=torch.float32, device=device)
    return float((tiny * 0.5).item()) == 0.0


def describe(device: torch.device | str) -> str:
    """:data:`KEPT` or :data:`FLUSHED`, for fingerprints and error messages."""
    return FLUSHED if flushes_subnormals(device) else KEPT
