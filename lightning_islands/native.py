"""Fused CPU codec kernels: a small C library compiled on first use and called through ctypes.

The reference implementation of every codec is plain torch (the ``lightning_islands.codecs``
package); on CPU the hot loops of the blockwise codecs, bf16 and fp32 run instead in
``csrc/liq_kernels.c``, which reads the input once and writes the output once (torch needs about six
passes over memory for the same work). Both produce the same bytes: the kernels are IEEE
single-precision operations with ``-ffp-contract=off``, and the tests compare them bit for bit.

The library is compiled with the system C compiler (``$CC``, else ``cc``) the first time a codec
runs and cached under ``$LI_NATIVE_CACHE`` (default ``~/.cache/lightning_islands``), keyed by a
hash of the source, flags and machine, and written atomically so concurrent processes are safe.
If there is no compiler (or ``LI_NATIVE=0``), the codecs use the torch path and say so once.
Work is split across ``torch.get_num_threads()`` threads; ctypes releases the GIL during calls.
Where torch computes with GNU OpenMP (libgomp, as the Linux wheels do), the library is built with
``-fopenmp`` against that same runtime and :func:`run_jobs` runs the per-thread calls on torch's own
OpenMP threads: they are still spinning from torch's last parallel operation, and threads of our
own would have to wait for their cores. ``LI_NATIVE_OPENMP=0`` builds without it (the calls then
run on :func:`thread_pool`, as they do where torch uses another runtime). Like torch's own parallel
operations, the kernels then cannot run in a process forked after the parent used them (GNU
OpenMP is not fork-safe: the child waits forever); start such children with ``spawn``, or set
``LI_NATIVE_OPENMP=0``.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor

__all__ = ["Job", "available", "disabled", "enabled", "kernel_checksums", "library", "openmp", "own_threads",
           "parallel_ranges", "ptr", "run_each", "run_jobs", "run_parallel", "run_ranges", "split", "thread_pool"]

_SOURCE = Path(__file__).parent / "csrc" / "liq_kernels.c"  # includes the other files of csrc/
_FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno"]
_OPENMP_FLAGS = ["-fopenmp"]
_OPENMP_RUNTIME = "libgomp.so.1"  # the runtime -fopenmp links (GCC's); torch's Linux wheels load one of this name
T = TypeVar("T")
A = TypeVar("A")
_I64, _I32, _U32, _P = ctypes.c_int64, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p
_SIGNATURES = {
    "liq_int_encode": [_P, _I64, _I64, _I32, _P, _P, _P],
    "liq_int_decode": [_P, _P, _I64, _I64, _I32, _P, _P],
    "liq_fp8_encode": [_P, _I64, _I64, _P, _P, _P],
    "liq_fp8_decode": [_P, _P, _I64, _I64, _P, _P],
    "liq_sign_encode": [_P, _I64, _I64, _P, _P, _P],
    "liq_sign_decode": [_P, _P, _I64, _I64, _P, _P],
    "liq_bf16_encode": [_P, _I64, _P, _P],
    "liq_bf16_decode": [_P, _I64, _P, _P],
    "liq_f32_copy_checked": [_P, _I64, _P, _P],
    "liq_topk_hist": [_P, _I64, _P],
    "liq_topk_pick": [_P, _I64, _I64, _I64, _I64, _P, _P, _I64, _P],
    "liq_topk_band_hist": [_P, _I64, _I64, _I64, _I64, _P],
    "liq_topk_band_bits": [_P, _I64, _I64, _I64, _P],
    "liq_topk_count": [_P, _I64, _I64, _P],
    "liq_topk_keep": [_P, _P, _I64, _I64, _P, _I64, _P, _P],
    "liq_ef_encode_part": [_P, _I64, _I32, _P, _I64, _P, _I64, _I64, _I64],
    "liq_popcount": [_P, _I64],
    "liq_ef_decode_part": [_P, _I64, _I64, _I32, _I64, _I64, _I64, _I64, _P],
    "liq_topk_scatter": [_P, _P, _I64, _I64, _I64, _P],
    "liq_streaming": [],
    "liq_crc32": [_U32, _P, _I64],
    "liq_crc_fast": [],
    "liq_job_id": [ctypes.c_char_p],
    "liq_run_jobs": [_P, _I64],
    "liq_openmp": [],
}
Job = tuple[str, Sequence[int]]  #: a kernel call: the kernel's name and its arguments (ints: pointers, sizes)
# these return an int64 count, liq_crc32 a CRC, the rest a status
_RETURNS_COUNT = {"liq_topk_pick", "liq_topk_band_hist", "liq_topk_band_bits", "liq_topk_count", "liq_topk_keep",
                  "liq_popcount", "liq_ef_decode_part"}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_fast_crc = False  # liq_crc_fast() of the loaded library
_openmp = False  # liq_openmp() of the loaded library
_job_ids: dict[str, int] = {}
_tried = False
_off = threading.local()  # .depth: nesting of disabled() in this thread; .own: of own_threads()
_pool: ThreadPoolExecutor | None = None
_pool_pid = -1


def _cache_dir() -> Path:
    root = os.environ.get("LI_NATIVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lightning_islands"
    )
    return Path(root)


def _openmp_wanted() -> bool:
    """Whether to build with OpenMP: GCC's runtime is already loaded in this process (by torch), so
    the library shares torch's threads instead of bringing a second runtime, and
    ``LI_NATIVE_OPENMP`` is not 0."""
    if os.environ.get("LI_NATIVE_OPENMP", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        ctypes.CDLL(_OPENMP_RUNTIME, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # only finds one already loaded
    except (OSError, AttributeError):  # not loaded, or no RTLD_NOLOAD on this platform
        return False
    return True


def _compile(compiler: str, flags: Sequence[str]) -> Path:
    source = b"".join(p.read_bytes() for p in sorted(_SOURCE.parent.glob("*.[ch]")))
    key = hashlib.sha256(
        source + " ".join(flags).encode() + platform.machine().encode() + platform.system().encode()
        + compiler.encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"liq_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent process sees the old state or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, compiling it on first use; None if unavailable (see module doc)."""
    global _lib, _tried, _fast_crc, _openmp
    if not enabled():
        return None
    if _tried:  # set only once _lib holds the outcome, so a caller racing the first compile waits below
        return _lib
    with _lock:
        if _tried:
            return _lib
        _lib = _load()
        _fast_crc = _lib is not None and bool(_lib.liq_crc_fast())
        _openmp = _lib is not None and bool(_lib.liq_openmp())
        _tried = True
        return _lib


def _load() -> ctypes.CDLL | None:
    """Compile (or find in the cache) and load the kernel library; None if it cannot be had."""
    if os.environ.get("LI_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        warnings.warn(f"lightning_islands: no C compiler ({compiler!r}) found; codecs use the slower torch "
                      "path (install gcc, or set CC, to get the fused CPU kernels)", stacklevel=4)
        return None
    builds = [[*_FLAGS, *_OPENMP_FLAGS], _FLAGS] if _openmp_wanted() else [_FLAGS]
    for i, flags in enumerate(builds):
        try:
            lib = ctypes.CDLL(str(_compile(compiler, flags)))
            break
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            if i + 1 < len(builds):  # no OpenMP for this compiler: the kernels run on threads of our own
                continue
            print(f"lightning_islands: fused codec kernels unavailable, using the torch path: {e}", file=sys.stderr)
            return None
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = (_I64 if name in _RETURNS_COUNT else _U32 if name == "liq_crc32"
                      else None if name == "liq_run_jobs" else ctypes.c_int)
    return lib


@contextlib.contextmanager
def _nested(counter: str) -> Iterator[None]:
    """Count one more level of ``counter`` (a field of :data:`_off`) in this thread for the block."""
    setattr(_off, counter, getattr(_off, counter, 0) + 1)
    try:
        yield
    finally:
        setattr(_off, counter, getattr(_off, counter) - 1)


def disabled() -> AbstractContextManager[None]:
    """Within the block, :func:`library` returns None and :func:`enabled` False in this thread: the
    codecs that this thread runs use their torch reference path, on every device (other threads
    keep the kernels)."""
    return _nested("depth")


def enabled() -> bool:
    """False inside :func:`disabled` (in this thread): no fused kernels, CPU or GPU, are to be used."""
    return not getattr(_off, "depth", 0)


def own_threads() -> AbstractContextManager[None]:
    """Within the block, :func:`run_jobs` in this thread runs its calls on :func:`thread_pool`
    even where the library could run them on torch's OpenMP threads (to compare the two)."""
    return _nested("own")


def openmp() -> bool:
    """Whether :func:`run_jobs` runs on torch's OpenMP threads in this thread (see the module doc)."""
    return library() is not None and _openmp and not getattr(_off, "own", 0)


def kernel_checksums() -> bool:
    """Whether the kernels take the payload checksum themselves (a carry-less-multiply CRC-32,
    x86-64 Linux with PCLMULQDQ); elsewhere their CRC-32 is a byte loop, ~100x slower than zlib-ng,
    and the codecs checksum separately. False inside :func:`disabled` or without kernels."""
    lib = library()
    return lib is not None and _fast_crc


def available() -> bool:
    """Whether the fused CPU kernels can be used in this process."""
    return library() is not None


def ptr(t: Tensor, offset: int = 0) -> int:
    """Address of element ``offset`` of a contiguous CPU tensor."""
    return t.data_ptr() + offset * t.element_size()


def parallel_ranges(count: int, unit: int, workers: int) -> list[tuple[int, int]]:
    """Split ``[0, count)`` into at most ``workers`` ranges whose starts are multiples of ``unit``."""
    units = -(-count // unit) if count else 0
    per = -(-units // max(1, workers)) if units else 0
    return [(s * unit, min((s + per) * unit, count)) for s in range(0, units, per)] if units else []


def thread_pool() -> ThreadPoolExecutor:
    """The process's worker threads for codec work (kernels, checksums); one per CPU, made on first use."""
    global _pool, _pool_pid
    with _lock:
        if _pool is None or _pool_pid != os.getpid():  # a forked child cannot use its parent's threads
            _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="liq-kernel")
            _pool_pid = os.getpid()
        return _pool


def split(count: int, unit: int, min_per_thread: int = 1 << 16) -> list[tuple[int, int]]:
    """The unit-aligned ranges of ``[0, count)`` that :func:`run_parallel` hands to its threads."""
    workers = max(1, min(torch.get_num_threads(), count // max(min_per_thread, 1)))
    return parallel_ranges(count, unit, workers)


def run_each(items: Sequence[A], call: Callable[[A], T]) -> list[T]:
    """Run ``call(item)`` for each item on the kernel threads (the first on the calling thread).

    Returns the results in item order. One item runs on the calling thread only.
    """
    if len(items) <= 1:
        return [call(item) for item in items]
    pool = thread_pool()
    futures = [pool.submit(call, item) for item in items[1:]]
    first = call(items[0])
    return [first, *(f.result() for f in futures)]


class _JobStruct(ctypes.Structure):
    _fields_ = [("kernel", ctypes.c_int64), ("arg", ctypes.c_int64 * 9), ("result", ctypes.c_int64)]  # liq_job


def _job_id(lib: ctypes.CDLL, name: str) -> int:
    if name not in _job_ids:
        kid = lib.liq_job_id(name.encode())
        if kid < 0:
            raise ValueError(f"{name} cannot run as a job (not in liq_job_names of csrc/liq_kernels.c)")
        _job_ids[name] = kid
    return _job_ids[name]


def run_jobs(jobs: Sequence[Job]) -> list[int]:
    """Run kernel calls ``(name, args)`` of the loaded library concurrently; their return values
    in order. On torch's OpenMP threads where :func:`openmp` says so (one foreign call for all of
    them, at most one thread per call and at most the OpenMP thread count of the calling thread:
    more calls are handed out as threads free up), else each on :func:`thread_pool` (the first on
    the calling thread)."""
    lib = library()
    if lib is None:
        raise RuntimeError("run_jobs needs the fused kernel library (see native.available())")
    if not openmp() or len(jobs) <= 1:
        return run_each(jobs, lambda job: int(getattr(lib, job[0])(*job[1])))
    table = (_JobStruct * len(jobs))()
    for slot, (name, args) in zip(table, jobs):
        slot.kernel = _job_id(lib, name)
        slot.arg[: len(args)] = [int(a) for a in args]
    lib.liq_run_jobs(table, len(jobs))
    return [slot.result for slot in table]


def run_ranges(ranges: Sequence[tuple[int, int]], call: Callable[[int, int], T]) -> list[T]:
    """Run ``call(start, stop)`` for each range on the kernel threads; results in range order."""
    return run_each(ranges, lambda r: call(*r))


def run_parallel(count: int, unit: int, call: Callable[[int, int], int], min_per_thread: int = 1 << 16) -> list[int]:
    """Run ``call(start, stop)`` over unit-aligned ranges of ``[0, count)`` on the kernel threads.

    Returns the calls' results in range order. Small inputs run on the calling thread.
    """
    return run_ranges(split(count, unit, min_per_thread), call)
