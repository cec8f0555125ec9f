"""Peak memory of each rank of an island while a round's vectors move in and out of the leader.

An island of ``--world`` gloo processes holds a synthetic model of ``--params`` fp32 values as
FSDP2-style DTensors (``Shard(0)`` over the island). Each rank runs one round's data movement the
way the strategy did until session 10 (``all-gather``: every rank builds the full pseudo-gradient
with ``CanonicalLayout.gather``, then receives the full merged vector by broadcast) and the way it
does now (``to leader``: ``gather_to_leader``, then ``scatter_from_leader``), each in a fresh
process, and reports how far the process's peak resident memory (``VmHWM``) rose above its level
before the round, in MiB and in full fp32 copies of the model. Linux only.

With ``--codec``, a round also does the work of ``IslandStrategy._exchange``: every rank adds its
shards of the error-feedback residual (allocated before the measurement: it persists between
rounds) to its pseudo-gradient; the leader encodes what it gathered, decodes its own payload and a
second island's (here its own payload again) and merges; the merged update and the new residual go
back to the ranks as shards. Three rows: the whole vector at once, chunks of ``--chunk-mib`` MiB
(``exchange_chunk_mib``) with the leader's chunk-sized temporaries reused from chunk to chunk
(``lightning_islands.buffers.Buffers``, as the strategy does), and the same chunks with fresh
temporaries for every chunk (as it did until session 14). Every row also gives each rank's wall
time for the round.

    PYTHONPATH=. python benchmarks/exchange_memory.py --params 50000000 --world 2 [--codec int8 --chunk-mib 64]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_islands import outer
from lightning_islands.buffers import Buffers, take
from lightning_islands.canonical import CanonicalLayout
from lightning_islands.codecs import make_codec


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size


def _leader_round(layout: CanonicalLayout, locals_: list, params: list, codec_spec: str,
                  chunk: int | None, reuse: bool) -> tuple[list, int]:
    """One round with the leader's exchange work (see the module docstring), a chunk at a time,
    its temporaries reused from chunk to chunk or not: the outer step's gradients, and the
    resident size before the round."""
    cpu = torch.device("cpu")
    codec = make_codec(codec_spec)
    # last round's residual, sharded like the model: it persists between rounds (written: resident)
    residual = [torch.empty_like(loc).fill_(0.0) for loc in locals_]
    dist.barrier()
    _reset_peak()
    base = _peak_rss()
    sent = [torch.add(loc, r) for loc, r in zip(locals_, residual)]
    chunks = outer.chunk_bounds(layout.numel, chunk)
    into = None if len(chunks) == 1 else [torch.zeros_like(loc) for loc in locals_]
    scratch = Buffers() if reuse else None  # None: every take is a fresh tensor
    leader = dist.get_rank() == 0
    for start, stop in chunks:
        m = stop - start
        part = layout.gather_to_leader(sent, params, cpu, start=start, stop=stop,
                                       into=take(scratch, "part", m) if leader else None)
        merged = dropped = None
        if part is not None:
            payload = codec.encode(part, out=take(scratch, "payload", codec.nbytes(m), torch.uint8), scratch=scratch)
            own = codec.decode(payload, out=take(scratch, "own", m), scratch=scratch)
            dropped = torch.sub(part, own, out=take(scratch, "residual", m))
            other = codec.decode(payload.clone(), out=take(scratch, "decoded1", m),  # the other island's, as received
                                 scratch=scratch)
            merged = outer.merge([own, other], [1.0, 1.0], out=take(scratch, "merged", m),
                                 scratch=take(scratch, "term", m))
            del part, own, payload, other
            if scratch is not None and stop == chunks[-1][1]:
                scratch.clear()  # as the strategy does: the last chunk's scatters get the room
        grads = layout.scatter_from_leader(merged, params, cpu, start=start, stop=stop, into=into)
        layout.scatter_from_leader(dropped, params, cpu, start=start, stop=stop, into=residual)
        del merged, dropped
    return grads, base


def _worker(rank: int, world: int, numel: int, mode: str, store: str, out: str, codec: str, chunk: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        names = [f"w{i}" for i in range(8)]  # 8 matrices of 1024 columns
        params = [distribute_tensor(torch.zeros(numel // 8 // 1024, 1024), mesh, [Shard(0)]) for _ in names]
        layout = CanonicalLayout(list(zip(names, params)))
        locals_ = [p.to_local() + 1.0 for p in params]  # the round's pseudo-gradient shards
        cpu = torch.device("cpu")
        dist.barrier()
        _reset_peak()
        base = _peak_rss()
        t0 = time.perf_counter()
        if mode.startswith("exchange"):
            grads, base = _leader_round(layout, locals_, params, codec, chunk if "chunk" in mode else None,
                                        reuse="fresh" not in mode)
            grads[0].reshape(-1)[:1] = 0.5  # (the merged value itself depends on the codec)
        elif mode == "all-gather":
            full = layout.gather(locals_, params)
            merged = full * 0.5 if rank == 0 else torch.empty_like(full)
            dist.broadcast(merged, src=0)
            grads = [layout.shard_of(merged, i, p) for i, p in enumerate(params)]
        else:
            full = layout.gather_to_leader(locals_, params, cpu)
            merged = full * 0.5 if full is not None else None
            full = None  # as the strategy does once the leader has encoded it
            grads = layout.scatter_from_leader(merged, params, cpu)
        assert float(grads[0].reshape(-1)[0]) == 0.5 if grads[0].numel() else True
        seconds = time.perf_counter() - t0
        rise = _peak_rss() - base
        got = {"rise": rise, "model_bytes": 4 * layout.numel, "seconds": seconds}
        Path(f"{out}.{rank}").write_text(json.dumps(got))
        # no rank tears the group down while another may still be in a collective: without this
        # barrier, about one run in ten aborted a rank ("terminate called without an active
        # exception") after the all-gather round
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=50_000_000, help="fp32 values in the model")
    parser.add_argument("--world", type=int, default=2, help="processes in the island")
    parser.add_argument("--codec", default=None, help="also time a round with the leader's work, in this codec")
    parser.add_argument("--chunk-mib", type=float, default=64.0, help="chunk of the chunked exchange row")
    parser.add_argument("--out", default="results/exchange_memory.json")
    args = parser.parse_args()
    chunk = outer.exchange_chunk_numel(args.chunk_mib, 2048)
    modes = ["all-gather", "to leader"]
    if args.codec:
        chunked = f"exchange {args.codec}, chunks of {args.chunk_mib:g} MiB"
        modes += [f"exchange {args.codec}", chunked, f"{chunked}, fresh buffers"]
    # Every rank of every row is a fresh process, forked from a server that imported torch and
    # lightning_islands once, rather than spawned to import them again: seconds of CPU per rank, most
    # of the run's time at small --params. (The server imports only what it is told to preload.)
    mp.set_forkserver_preload(["lightning_islands"])
    rows = []
    for mode in modes:
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(_worker, args=(args.world, args.params, mode, os.path.join(tmp, "store"),
                                              os.path.join(tmp, "out"), args.codec, chunk),
                               nprocs=args.world, start_method="forkserver")
            for rank in range(args.world):
                got = json.loads(Path(tmp, f"out.{rank}").read_text())
                rows.append({"mode": mode, "rank": rank, "rise_mib": got["rise"] / 2**20,
                             "copies": got["rise"] / got["model_bytes"], "model_mib": got["model_bytes"] / 2**20,
                             "seconds": got["seconds"]})
    print(f"island of {args.world} gloo processes, model of {rows[0]['model_mib']:.0f} MiB fp32")
    width = max(len(m) for m in modes) + 2
    print(f"{'round':<{width}}{'rank':>5}{'peak rise MiB':>15}{'full copies':>13}{'seconds':>9}")
    for r in rows:
        print(f"{r['mode']:<{width}}{r['rank']:>5}{r['rise_mib']:>15.0f}{r['copies']:>13.2f}{r['seconds']:>9.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"world": args.world, "params": args.params, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
