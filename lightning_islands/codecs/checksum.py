"""CRC-32 (zlib polynomial) of payloads: zlib(-ng) in threads on CPU, a Triton kernel on GPUs.

Large bodies are checksummed in pieces, concurrently, and the pieces' CRCs are combined exactly
(:mod:`lightning_islands.codecs.crc32`).
"""

from __future__ import annotations

import os
import threading
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from lightning_islands.codecs import crc32, paths

try:  # same CRC-32 as zlib, ~10x faster (PCLMUL); optional
    from zlib_ng import zlib_ng as _zlib_fast
except ImportError:  # pragma: no cover - depends on the environment
    _zlib_fast = None
_CRC32 = _zlib_fast.crc32 if _zlib_fast is not None else zlib.crc32  # zlib's CRC-32 (a running value, bytes)
IMPLEMENTATION = "zlib-ng" if _zlib_fast is not None else "zlib"  #: what takes CRCs on the host

_CRC_PARALLEL_MIN_BYTES = 4 << 20
_CRC_PIECE_MIN_BYTES = 1 << 20
_CRC_WORKERS = min(8, os.cpu_count() or 1)
_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
_pool_lock = threading.Lock()


def _thread_pool() -> ThreadPoolExecutor:
    """The process's threads for checksumming large bodies, made on first use (anew in a forked
    child, which cannot use its parent's threads)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=_CRC_WORKERS, thread_name_prefix="liq-crc")
            _pool_pid = os.getpid()
        return _pool


def crc32_of(prefix: bytes, body: Tensor) -> int:
    """``zlib.crc32(prefix + body)`` for a uint8 tensor on any device, parallel for big bodies.

    zlib(-ng).crc32 releases the GIL on large buffers, so pieces run concurrently on a thread
    pool; the per-piece CRCs are merged with :func:`crc32.join` into exactly the CRC of the
    concatenation.
    """
    crc = zlib.crc32(prefix)
    if body.numel() == 0:
        return crc
    raw = device_raw_crc(body)
    if raw is not None:  # taken on the GPU: the body stays there
        return crc32.from_raw(crc, raw, body.numel())
    data = (body if body.device.type == "cpu" else body.cpu()).numpy()
    size = data.shape[0]
    if size < _CRC_PARALLEL_MIN_BYTES or _CRC_WORKERS < 2:
        return _CRC32(data, crc)
    pool = _thread_pool()
    piece = max(_CRC_PIECE_MIN_BYTES, -(-size // _CRC_WORKERS))
    bounds = [(s, min(s + piece, size)) for s in range(0, size, piece)]
    futures = [pool.submit(_CRC32, data[s:e]) for s, e in bounds[1:]]
    first = _CRC32(data[bounds[0][0] : bounds[0][1]], crc)
    return crc32.join([(first, 0)] + [(fut.result(), e - s) for (s, e), fut in zip(bounds[1:], futures)])


_GPU_CRC_MIN_BYTES = 256 << 10  # below this, copying the body to the host costs less than the kernel launches
CRC_PROBE_BYTES = (1 << 20) + 777  # three fold levels of triton_crc, the last ones partial
CRC_KERNEL_TRUSTED: dict[str, bool] = {}  # device -> the GPU CRC-32 kernel agreed with zlib there


def device_raw_crc(body: Tensor) -> int | None:
    """The raw CRC-32 of a CUDA body taken on its GPU (:mod:`lightning_islands.codecs.triton_crc`); None
    for small or CPU bodies, without triton, with ``LI_TRITON=0``, or where the kernel failed its
    check against zlib on this device."""
    if body.device.type != "cuda" or body.numel() < _GPU_CRC_MIN_BYTES:
        return None
    if paths.triton_mode() == "0" or paths.import_triton_kernels() is None:
        return None
    from lightning_islands.codecs import triton_crc

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
