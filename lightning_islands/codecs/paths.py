"""Which path a tensor takes: the Triton kernels on CUDA (blockwise codecs), else the torch reference.

``LI_TRITON`` selects the Triton kernels (see :func:`triton_mode`); it is read on every call, so
setting it to 0 for a block of code runs that code on the torch path. Every path writes the same
bytes.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

from torch import Tensor


def triton_mode() -> str:
    """``LI_TRITON``: "1" (default) Triton kernels for CUDA tensors, "0" never, "interpret" also for
    CPU tensors under Triton's interpreter (needs ``TRITON_INTERPRET=1``; slow, for checking the
    GPU kernels on a machine without one)."""
    mode = os.environ.get("LI_TRITON", "1").strip().lower()
    if mode in ("0", "false", "no", "off"):
        return "0"
    return "interpret" if mode == "interpret" else "1"


@functools.cache
def import_triton_kernels() -> Any:
    """:mod:`lightning_islands.codecs.triton_kernels`, or None (said once) if triton cannot be imported."""
    try:
        from lightning_islands.codecs import triton_kernels
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken triton install failing on import
        warnings.warn(f"lightning_islands: triton is not importable ({e}); the codecs use the slower torch "
                      "path on the GPU (pip install triton)", stacklevel=5)
        return None
    return triton_kernels


def triton_module(t: Tensor) -> Any:
    """:mod:`lightning_islands.codecs.triton_kernels` if the blockwise codecs should run it on
    ``t``'s device, else None (the torch path)."""
    mode = triton_mode()
    if mode == "0" or t.device.type != ("cpu" if mode == "interpret" else "cuda"):
        return None
    triton_kernels = import_triton_kernels()
    if triton_kernels is None:
        return None
    if mode == "interpret" and not triton_kernels.interpreted():
        raise RuntimeError("LI_TRITON=interpret runs the codec kernels under Triton's interpreter, which needs "
                           "TRITON_INTERPRET=1 in the environment before Python starts; set it, or unset LI_TRITON")
    return triton_kernels
