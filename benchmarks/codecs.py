"""Throughput and accuracy of the pseudo-gradient codecs, against ``torch.Tensor.copy_``.

For every codec, in the same run and interleaved with a ``copy_`` of the same fp32 tensor (so both
see the same machine state), this measures:

* ``enc`` / ``dec``: :meth:`Codec.encode` / :meth:`Codec.decode` with reused output buffers
  (``out=``) and temporaries (``scratch=``), i.e. the steady state of an outer loop that keeps
  its buffers (as a round's chunks do);
* ``alloc``: the same with fresh outputs (on CPU, page-faulting fresh multi-MiB allocations can cost
  more than the codec itself);
* ``kern``: the body alone (quantize+pack / unpack+dequantize), without the header and its
  checksum (``crc ms`` is one CRC-32 of the whole payload, paid once per direction);
* ``2pass/copy`` (CUDA, blockwise codecs): ``kern`` with the Triton encoder reading the input twice
  (``LI_TRITON_ONE_PASS=0``: block scales, then values) instead of once, side by side;
* ``torch rt/copy`` (CUDA): the round trip on the torch reference path (``LI_TRITON=0``), i.e. what
  a GPU without triton runs, side by side with the Triton kernels that the other columns use for
  the blockwise codecs (``lightning_islands/codecs/triton_kernels.py``; the checksum of bodies of
  256 KiB and more is then taken on the GPU, ``triton_crc.py``). On CPU every column is the torch
  path.

Before every timed operation a read-only pass over a clean buffer of twice the last-level cache
(``--scrub-mib``) writes back and evicts what the previous operation left in the caches, so each
operation (``copy_`` included) starts from the same state: cold and clean. Without it, the
operation that follows a big write pays for that write's dirty lines (on the CPU VM of
docs/BENCHMARKS.md, an encode timed right after ``copy_`` took up to 2x longer than the same
encode back to back). ``--scrub-mib 0`` switches it off.

Throughputs are GB/s of fp32 input (4 * numel bytes / time); ``copy_`` GB/s is measured the same
way (it reads and writes 4 * numel bytes). ``rt/copy`` = copy_ time / (encode + decode time),
taken per round (the ops of one round run back to back, so both see the same machine state) and
reported as the median over rounds; the other ratio columns likewise. Times are medians over
``--repeats`` after ``--warmup`` rounds.

    PYTHONPATH=. python benchmarks/codecs.py --numel $((1<<22)) --repeats 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from lightning_islands import codecs as C
from lightning_islands.codecs import blockwise, checksum, paths
from lightning_islands.codecs.buffers import Buffers

DEFAULT_CODECS = "fp32,bf16,fp8,int8,int4,int2,sign,topk:0.01,topk:0.01+int4"


def _timer(device: torch.device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    return timed


def _last_level_cache_bytes() -> int:
    """Size of the largest CPU cache (sysfs), or 32 MiB if it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * unit)
        except ValueError:
            continue
    return max(sizes, default=32 << 20)


def _scrubber(device: torch.device, mib: int):
    """A function that streams through a clean ``mib`` MiB buffer on ``device`` (no-op if 0)."""
    if mib <= 0:
        return lambda: None
    buf = torch.ones(mib << 18, device=device)  # mib MiB of fp32

    def scrub() -> None:
        buf.sum()

    return scrub


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` within the block (the codecs read these switches on every call)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def _reference(fn) -> None:
    """``fn()`` on the torch reference path (no Triton kernels)."""
    with _env("LI_TRITON", "0"):
        fn()


def _two_pass(fn) -> None:
    """``fn()`` with the Triton blockwise encoder in its two-pass form (scales, then values)."""
    with _env("LI_TRITON_ONE_PASS", "0"):
        fn()


def bench_codec(spec: str, x: torch.Tensor, args: argparse.Namespace, timed) -> dict:
    codec = C.make_codec(spec, block_size=args.block_size)
    n = x.numel()
    payload = codec.encode(x)
    decoded = codec.decode(payload)
    body = payload[C.HEADER_BYTES :]
    k = codec._count(n)
    pbuf = torch.empty_like(payload)
    dbuf = torch.empty_like(x)
    kbody = torch.empty_like(body)
    y = torch.empty_like(x)
    sbuf = Buffers()
    ops = {
        "copy": lambda: y.copy_(x),
        "enc": lambda: codec.encode(x, out=pbuf, scratch=sbuf),
        "dec": lambda: codec.decode(payload, out=dbuf, scratch=sbuf),
        "enc_alloc": lambda: codec.encode(x),
        "dec_alloc": lambda: codec.decode(payload),
        "kern_enc": lambda: codec._encode_body(x, kbody, sbuf),
        "kern_dec": lambda: codec._decode_body(body, n, k, dbuf, sbuf),
        "crc": lambda: checksum.crc32_of(b"", body),
    }
    triton = paths.triton_module(x) is not None  # else every op already runs the torch path
    if triton:
        ops["enc_ref"] = lambda: _reference(lambda: codec.encode(x, out=pbuf, scratch=sbuf))
        ops["dec_ref"] = lambda: _reference(lambda: codec.decode(payload, out=dbuf, scratch=sbuf))
    two_pass = triton and isinstance(codec, blockwise.BlockCodec)
    if two_pass:
        ops["kern_enc_2pass"] = lambda: _two_pass(lambda: codec._encode_body(x, kbody, sbuf))
    samples: dict[str, list[float]] = {name: [] for name in ops}
    for r in range(args.warmup + args.repeats):
        for name, fn in ops.items():
            args.scrub()
            t = timed(fn)
            if r >= args.warmup:
                samples[name].append(t)
    med = {name: statistics.median(ts) for name, ts in samples.items()}
    best = {name: min(ts) for name, ts in samples.items()}
    gbs = lambda t: 4 * n / t / 1e9  # noqa: E731

    def over_copy(enc: str, dec: str) -> float:
        """Median over rounds of copy_ time / (enc + dec time) of the same round."""
        return statistics.median(c / (e + d) for c, e, d in zip(samples["copy"], samples[enc], samples[dec]))
    return {
        "codec": codec.name,
        "spec": codec.spec(),
        "payload_bytes": payload.numel(),
        "bytes_per_elem": payload.numel() / n,
        "compression_ratio": C.compression_ratio(n, payload.numel()),
        "rel_error_gaussian": C.quantization_error(x, decoded),
        "median_ms": {name: t * 1e3 for name, t in med.items()},
        "min_ms": {name: t * 1e3 for name, t in best.items()},
        "copy_gbs": gbs(med["copy"]),
        "enc_gbs": gbs(med["enc"]),
        "dec_gbs": gbs(med["dec"]),
        "roundtrip_gbs": gbs(med["enc"] + med["dec"]),
        "roundtrip_over_copy": over_copy("enc", "dec"),
        "kernel_roundtrip_over_copy": over_copy("kern_enc", "kern_dec"),
        "alloc_roundtrip_over_copy": over_copy("enc_alloc", "dec_alloc"),
        "torch_roundtrip_over_copy": over_copy("enc_ref", "dec_ref") if triton else None,
        "kernel_two_pass_over_copy": over_copy("kern_enc_2pass", "kern_dec") if two_pass else None,
        "crc_ms": med["crc"] * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 24, help="elements of the fp32 vector")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds per codec (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per codec")
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    parser.add_argument("--codecs", default=DEFAULT_CODECS, help="comma-separated codec specs")
    parser.add_argument("--block-size", type=int, default=C.DEFAULT_BLOCK_SIZE)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as is)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/codecs.json")
    parser.add_argument("--scrub-mib", type=int, default=None,
                        help="MiB read before each timed op to leave the caches cold and clean (default: twice "
                             "the CPU's last-level cache on CPU, 128 on CUDA; 0: off)")
    args = parser.parse_args(argv)

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.numel, generator=gen).to(device)
    timed = _timer(device)
    if args.scrub_mib is None:
        args.scrub_mib = 2 * _last_level_cache_bytes() >> 20 if device.type == "cpu" else 128
    args.scrub = _scrubber(device, args.scrub_mib)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(
        f"device={device} ({name}) torch={torch.__version__} threads={torch.get_num_threads()} "
        f"numel={args.numel} ({4 * args.numel / 2**20:.0f} MiB fp32) repeats={args.repeats} (median) "
        f"scrub={args.scrub_mib} MiB "
        f"crc32={checksum.IMPLEMENTATION} "
        f"triton={_triton_version()}"
    )

    results = []
    for spec in [s.strip() for s in args.codecs.split(",") if s.strip()]:
        results.append(bench_codec(spec, x, args, timed))

    triton_columns = paths.triton_module(x) is not None
    cols = (
        f"{'codec':<20} {'B/elem':>7} {'ratio':>7} {'rel.err':>8} {'enc GB/s':>9} {'dec GB/s':>9} "
        f"{'rt GB/s':>8} {'copy GB/s':>9} {'rt/copy':>8} {'kern/copy':>9} {'alloc/copy':>10} "
        f"{'crc ms':>7}" + (f" {'torch rt/copy':>13} {'2pass/copy':>10}" if triton_columns else "")
    )
    print(cols)
    print("-" * len(cols))
    for r in results:
        print(
            f"{r['codec']:<20} {r['bytes_per_elem']:>7.3f} {r['compression_ratio']:>7.2f} "
            f"{r['rel_error_gaussian']:>8.2e} {r['enc_gbs']:>9.2f} {r['dec_gbs']:>9.2f} "
            f"{r['roundtrip_gbs']:>8.2f} {r['copy_gbs']:>9.2f} {r['roundtrip_over_copy']:>8.2f} "
            f"{r['kernel_roundtrip_over_copy']:>9.2f} {r['alloc_roundtrip_over_copy']:>10.2f} "
            f"{r['crc_ms']:>7.2f}"
            + (f" {r['torch_roundtrip_over_copy']:>13.2f} {r['kernel_two_pass_over_copy'] or float('nan'):>10.2f}"
               if triton_columns else "")
        )

    if device.type == "cuda":
        trusted = {name: ok for (dev, name), ok in blockwise.TRITON_TRUSTED.items() if dev == str(x.device)}
        print(f"Triton kernels that passed their first-use check on {x.device}: {trusted or 'none ran'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": str(device),
        "device_name": name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "numel": args.numel,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "scrub_mib": args.scrub_mib,
        "block_size": args.block_size,
        "format_version": C.FORMAT_VERSION,
        "crc32": checksum.IMPLEMENTATION,
        "triton": _triton_version(),
        "triton_trusted": {f"{dev} {name}": ok for (dev, name), ok in blockwise.TRITON_TRUSTED.items()},
        "timing": "median seconds over repeats; GB/s = 4*numel bytes / time; ratios: median over rounds "
                  "of the same round's copy_ time / round-trip time",
    }
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
