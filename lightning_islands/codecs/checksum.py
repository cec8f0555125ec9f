"""CRC-32 (zlib polynomial) of payloads: zlib(-ng) in threads on CPU, a Triton kernel on GPUs.

Large bodies are checksummed in pieces, concurrently, and the pieces' CRCs are combined exactly
(:mod:`lightning_islands.crc32`). The fused CPU kernels take the CRC of what they write or read
while it is in cache (:func:`run_checksummed`), so most encodes and decodes pay no separate pass.
"""

from __future__ import annotations

import ctypes
import os
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_islands import crc32, native
from lightning_islands.codecs import paths
from lightning_islands.crc32 import crc32_combine

try:  # same CRC-32 as zlib, ~10x faster (PCLMUL); optional
    from zlib_ng import zlib_ng as _zlib_fast
except ImportError:  # pragma: no cover - depends on the environment
    _zlib_fast = None
_CRC32 = _zlib_fast.crc32 if _zlib_fast is not None else zlib.crc32  # zlib's CRC-32 (a running value, bytes)
IMPLEMENTATION = "zlib-ng" if _zlib_fast is not None else "zlib"  #: what takes CRCs on the host

_CRC_PARALLEL_MIN_BYTES = 4 << 20
_CRC_PIECE_MIN_BYTES = 1 << 20
_CRC_WORKERS = min(8, os.cpu_count() or 1)


def crc32_of(prefix: bytes, body: Tensor) -> int:
    """``zlib.crc32(prefix + body)`` for a uint8 tensor on any device, parallel for big bodies.

    zlib(-ng).crc32 releases the GIL on large buffers, so pieces run concurrently on
    :func:`native.thread_pool`; the per-piece CRCs are merged with :func:`crc32_combine` into
    exactly the CRC of the concatenation.
    """
    crc = zlib.crc32(prefix)
    if body.numel() == 0:
        return crc
    raw = device_raw_crc(body)
    if raw is not None:  # taken on the GPU: the body stays there
        return crc32.from_raw(crc, raw, body.numel())
    data = (body if body.device.type == "cpu" else body.cpu()).numpy()
    size = data.shape[0]
    pool = native.thread_pool() if size >= _CRC_PARALLEL_MIN_BYTES and _CRC_WORKERS >= 2 else None
    if pool is None:
        return _CRC32(data, crc)
    piece = max(_CRC_PIECE_MIN_BYTES, -(-size // _CRC_WORKERS))
    bounds = [(s, min(s + piece, size)) for s in range(0, size, piece)]
    futures = [pool.submit(_CRC32, data[s:e]) for s, e in bounds[1:]]
    first = _CRC32(data[bounds[0][0] : bounds[0][1]], crc)
    return crc32.join([(first, 0)] + [(fut.result(), e - s) for (s, e), fut in zip(bounds[1:], futures)])


_GPU_CRC_MIN_BYTES = 256 << 10  # below this, copying the body to the host costs less than the kernel launches
CRC_PROBE_BYTES = (1 << 20) + 777  # three fold levels of lightning_islands.triton_crc, the last ones partial
CRC_KERNEL_TRUSTED: dict[str, bool] = {}  # device -> the GPU CRC-32 kernel agreed with zlib there


def device_raw_crc(body: Tensor) -> int | None:
    """The raw CRC-32 of a CUDA body taken on its GPU (:mod:`lightning_islands.triton_crc`); None
    for small or CPU bodies, without triton, with ``LI_TRITON=0`` or :func:`native.disabled`, or
    where the kernel failed its check against zlib on this device."""
    if body.device.type != "cuda" or body.numel() < _GPU_CRC_MIN_BYTES:
        return None
    if not native.enabled() or paths.triton_mode() == "0" or paths.import_triton_kernels() is None:
        return None
    from lightning_islands import triton_crc

    return triton_crc.raw_crc(body) if crc_kernel_trusted(triton_crc, body.device) else None


def crc_kernel_trusted(module: Any, device: torch.device) -> bool:
    """Whether ``module.raw_crc`` gives zlib's CRC-32 on ``device``, checked once per device on a
    fixed random probe; a kernel that disagrees (or fails) is not used there, with a warning."""
    key = str(device)
    if key not in CRC_KERNEL_TRUSTED:
        g = torch.Generator().manual_seed(0x11C)
        probe = torch.randint(0, 256, (CRC_PROBE_BYTES,), dtype=torch.uint8, generator=g)
        want = zlib.crc32(probe.numpy().tobytes())
        try:
            got = crc32.from_raw(0, module.raw_crc(probe.to(device)), probe.numel())
            problem = None if got == want else f"CRC-32 {got:#010x} where zlib gives {want:#010x}"
        except Exception as e:  # noqa: BLE001 - a kernel that does not compile here is a reason to fall back
            problem = f"{type(e).__name__}: {e}"
        CRC_KERNEL_TRUSTED[key] = problem is None
        if problem is not None:
            warnings.warn(f"lightning_islands: the GPU CRC-32 kernel on {device} failed its check ({problem}); "
                          "payload checksums there are taken on the host (slower, same value)", stacklevel=2)
    return CRC_KERNEL_TRUSTED[key]


def payload_crc(prefix: bytes, body: Tensor, body_crc: int | None) -> int:
    """CRC-32 of ``prefix + body``, from ``body_crc`` (the body's own CRC-32) where a fused kernel
    already took it, else by reading the body."""
    if body_crc is None:
        return crc32_of(prefix, body)
    return crc32_combine(zlib.crc32(prefix), body_crc, body.numel())


def crc_piece(t: Tensor) -> tuple[int, int]:
    """``(crc32, nbytes)`` of the bytes of a contiguous CPU tensor (zlib conditioning, no prefix):
    for a small piece of a body whose bulk a fused kernel checksummed (see :func:`run_checksummed`)."""
    data = t.view(torch.uint8).numpy()
    return _CRC32(data), data.shape[0]


def run_checksummed(count: int, unit: int, job: Callable[[int, int, int], native.Job],
                    parts: Callable[[int, int], tuple[Tensor, ...]]) -> tuple[list[int], int]:
    """Run a fused kernel over ``[0, count)`` on the kernel threads, checksumming the body as it goes.

    Each thread takes one unit-aligned range ``[start, stop)`` and runs the kernel call
    ``job(start, stop, crc)`` (see :func:`native.run_jobs`), where ``crc`` is the address of one
    running CRC-32 (uint32, starting at 0) per body part
    (``parts(start, stop)`` are the range's pieces of each part, say its scales and its values).
    The kernel advances each over its piece of that part while the bytes are in cache: right after
    writing them (encode) or right before reading them (decode). Returns the kernel statuses and
    the CRC-32 of the body, i.e. of part 0 over all ranges in order, then part 1, and so on; or
    None for the CRC where the kernels have no fast CRC-32 (:func:`native.kernel_checksums`): they
    then get a null address and the caller checksums the body with zlib(-ng).
    """
    ranges = native.split(count, unit)
    if not native.kernel_checksums():
        return native.run_jobs([job(s, e, 0) for s, e in ranges]), None
    nparts = len(parts(0, 0))
    crcs = (ctypes.c_uint32 * max(1, len(ranges) * nparts))()  # alive until the kernels are done
    statuses = native.run_jobs([job(s, e, ctypes.addressof(crcs) + 4 * nparts * i) for i, (s, e) in enumerate(ranges)])
    sizes = [[t.numel() * t.element_size() for t in parts(s, e)] for s, e in ranges]
    crc = crc32.join([(crcs[i * nparts + p], sizes[i][p]) for p in range(nparts) for i in range(len(ranges))])
    return statuses, crc
