"""Throughput of authenticated payloads (``lightning_islands/link/auth.py``) against link rates.

For payloads of 1 MB to 1 GB this times what :class:`~lightning_islands.link.auth.AuthenticatedLink`
adds to a payload call:

* ``sign``: a fresh buffer with room for the tag, the copy of the payload into it (the one
  concatenation) and the tag (a MAC tree over 4 MiB pieces, in a thread pool);
* ``verify``: the tag of a received payload, recomputed and compared (no copy);
* ``copy``: the concatenation's memcpy alone, into a buffer allocated once.

and compares the slower of sign and verify with links of 25 Gbit/s (the 1T-parameter int4 case of
the streaming benchmark) and 1 Gbit/s: ``x 25 Gbit/s`` above 1 means the MAC keeps up with that link.

A second table compares constructions on the largest payload: one HMAC-SHA256 (OpenSSL) over the
whole payload in one thread, keyed BLAKE2b the same way, a plain SHA-256 for reference, and the MAC
tree of HMAC-SHA256 and of keyed BLAKE2b with 1, 2, ... threads and several piece sizes.

Columns: ``MB/s`` is the payload over the best wall time of ``--repeats`` runs (after one warm-up;
on a shared machine the least disturbed run); ``MB per CPU-s`` the payload over the median CPU time
of the process, all its threads: what the work costs a core, however busy the machine; ``CPU-s per
s`` the most CPU seconds one run used per wall second (above 1: its threads hashed at once, so
hashlib released the GIL). MB = 1e6 bytes.

    PYTHONPATH=. python benchmarks/auth.py [--quick] --out DIR

writes ``DIR/auth.json`` and prints both tables in markdown.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lightning_islands.link import auth

SIZES_MB = (1, 16, 256, 1024)
QUICK_SIZES_MB = (0.25, 1, 8)
LINKS_GBIT = (25.0, 1.0)


class _Stub:
    """The least a Link needs to be wrapped (the benchmark calls the signing and checking directly)."""

    island, num_islands = 0, 2

    def close(self) -> None:
        pass


def _timed(fn, repeats: int) -> tuple[float, float, float]:
    """Of ``fn()``: the best wall seconds, the median CPU seconds of the process (all its threads)
    and the highest CPU seconds per wall second of one run (above 1: threads ran at once)."""
    fn()  # warm-up: page faults, thread pool start
    walls, cpus = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return min(walls), statistics.median(cpus), max(c / w for c, w in zip(cpus, walls))


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def bench_size(link: auth.AuthenticatedLink, mb: float, repeats: int) -> dict:
    n = int(mb * 1e6)
    payload = torch.randint(0, 256, (n,), dtype=torch.uint8)
    header = auth.payload_header("gather", "", 1, 1, 1, 2, n)
    signed = link._signed(payload, header)
    link._check("bench", [1], [signed], [header])  # the tag verifies
    out, src = memoryview(torch.empty(n + auth.TAG_BYTES, dtype=torch.uint8).numpy()), memoryview(payload.numpy())
    row: dict = {"mb": mb, "bytes": n}

    def copy() -> None:  # the copy that signing makes (a memcpy of the payload)
        out[:n] = src

    for op, fn in (("sign", lambda: link._signed(payload, header)),
                   ("verify", lambda: link._check("bench", [1], [signed], [header])),
                   ("copy", copy)):
        wall, cpu, _ = _timed(fn, repeats)
        row.update({f"{op}_s": wall, f"{op}_cpu_s": cpu, f"{op}_mbps": _mbps(n, wall),
                    f"{op}_mbps_per_cpu_s": _mbps(n, cpu)})
    row["gbit_s"] = n * 8 / max(row["sign_s"], row["verify_s"]) / 1e9
    row.update({f"x_{g:g}gbit": row["gbit_s"] / g for g in LINKS_GBIT})
    return row


def bench_sizes(sizes_mb, repeats: int, threads: int | None) -> list[dict]:
    link = auth.AuthenticatedLink(_Stub(), b"benchmark-secret-0123456789", "bench", threads=threads)
    rows = [bench_size(link, mb, repeats) for mb in sizes_mb]
    link.close()
    return rows


def _tree(make, data: memoryview, piece: int, pool: ThreadPoolExecutor | None) -> bytes:
    pieces = [data[i : i + piece] for i in range(0, len(data), piece)]

    def leaf(p: memoryview) -> bytes:
        h = make()
        h.update(p)
        return h.digest()

    leaves = list(pool.map(leaf, pieces)) if pool is not None else [leaf(p) for p in pieces]
    root = make()
    root.update(b"".join(leaves))
    return root.digest()


def bench_constructions(mb: float, repeats: int, max_threads: int) -> list[dict]:
    n = int(mb * 1e6)
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8)
    data = memoryview(buf.numpy())
    key = os.urandom(32)
    makers = {
        "hmac-sha256": lambda: hmac.new(key, digestmod="sha256"),
        "blake2b keyed": lambda: hashlib.blake2b(key=key, digest_size=32),
    }
    rows = []

    def add(name: str, threads: int, piece_mib: float | None, fn) -> None:
        wall, cpu, parallel = _timed(fn, repeats)
        rows.append({"construction": name, "threads": threads, "piece_mib": piece_mib, "seconds": wall,
                     "cpu_seconds": cpu, "mbps": _mbps(n, wall), "mbps_per_cpu_s": _mbps(n, cpu),
                     "gbit_s": n * 8 / wall / 1e9, "cpu_per_wall": parallel})

    add("sha256 (no key, reference)", 1, None, lambda: hashlib.sha256(data).digest())
    for name, make in makers.items():
        add(name, 1, None, lambda make=make: (lambda h: (h.update(data), h.digest()))(make()))
    thread_counts = sorted({1, 2, 4, 8, max_threads} & set(range(1, max_threads + 1)))
    for name, make in makers.items():
        for t in thread_counts:
            pool = ThreadPoolExecutor(t) if t > 1 else None
            add(f"tree {name}", t, 4, lambda make=make, pool=pool: _tree(make, data, 4 << 20, pool))
            if pool is not None:
                pool.shutdown()
    pool = ThreadPoolExecutor(max_threads) if max_threads > 1 else None
    for piece in (1, 16, 64):
        add("tree hmac-sha256", max_threads, piece, lambda piece=piece: _tree(makers["hmac-sha256"], data,
                                                                             piece << 20, pool))
    if pool is not None:
        pool.shutdown()
    out = memoryview(torch.empty(n + 32, dtype=torch.uint8).numpy())

    def copy() -> None:
        out[:n] = data

    add("memcpy (appending the tag)", 1, None, copy)
    return rows


def _fmt_mb(mb: float) -> str:
    return f"{mb:g} MB" if mb < 1000 else f"{mb / 1000:g} GB"


def markdown(result: dict) -> str:
    lines = ["| payload | MB/s sign | MB/s verify | MB/s copy | Gbit/s | x 25 Gbit/s | x 1 Gbit/s "
             "| MB per CPU-s sign | verify |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["sizes"]:
        lines.append(f"| {_fmt_mb(r['mb'])} | {r['sign_mbps']:,.0f} | {r['verify_mbps']:,.0f} | {r['copy_mbps']:,.0f} "
                     f"| {r['gbit_s']:.2f} | {r['x_25gbit']:.3f} | {r['x_1gbit']:.2f} "
                     f"| {r['sign_mbps_per_cpu_s']:,.0f} | {r['verify_mbps_per_cpu_s']:,.0f} |")
    lines += ["", f"Constructions on {_fmt_mb(result['meta']['compare_mb'])}:", "",
              "| construction | threads | piece MiB | MB/s | Gbit/s | MB per CPU-s | CPU-s per s |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["constructions"]:
        piece = "" if r["piece_mib"] is None else f"{r['piece_mib']:g}"
        lines.append(f"| {r['construction']} | {r['threads']} | {piece} | {r['mbps']:,.0f} | {r['gbit_s']:.2f} "
                     f"| {r['mbps_per_cpu_s']:,.0f} | {r['cpu_per_wall']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small payloads (seconds, for tests)")
    parser.add_argument("--sizes-mb", type=str, default=None, help="comma-separated payload sizes in MB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="MAC threads (default: as AuthenticatedLink)")
    parser.add_argument("--out", type=Path, default=None, help="directory for auth.json")
    args = parser.parse_args()
    sizes = ([float(s) for s in args.sizes_mb.split(",")] if args.sizes_mb
             else QUICK_SIZES_MB if args.quick else SIZES_MB)
    repeats = 2 if args.quick and args.repeats == 5 else args.repeats
    threads = auth.AuthenticatedLink(_Stub(), b"x" * 16, "r", threads=args.threads).threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    meta = {"threads": threads, "cores": cores, "piece_bytes": auth.PIECE_BYTES, "scheme": auth.SCHEME,
            "repeats": repeats, "compare_mb": max(sizes), "torch": torch.__version__,
            "python": platform.python_version(), "machine": platform.machine(),
            "openssl": __import__("ssl").OPENSSL_VERSION, "load_avg": os.getloadavg()}
    print(f"# auth throughput: {cores} cores, {threads} MAC threads, pieces of {auth.PIECE_BYTES >> 20} MiB, "
          f"load average {meta['load_avg'][0]:.1f}", flush=True)
    result = {"meta": meta, "sizes": bench_sizes(sizes, repeats, args.threads),
              "constructions": bench_constructions(max(sizes), repeats, max(threads, cores or 1))}
    print(markdown(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "auth.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
