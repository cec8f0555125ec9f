"""Peak memory of each rank of an island while a round's vectors move in and out of the leader.

An island of ``--world`` gloo processes holds a synthetic model of ``--params`` fp32 values as
FSDP2-style DTensors (``Shard(0)`` over the island). Each rank runs, each in a fresh process:

- ``to leader``: the round's data movement alone (``CanonicalLayout.gather_to_leader``, then
  ``scatter_from_leader`` of the leader's result);
- with ``--codec``, the engine's real round (``IslandEngine.start``, a lone island, so no link): every
  rank adds its shards of the error-feedback residual to its pseudo-gradient, the leader encodes what
  it gathered, decodes it and merges, and the merged update and the new residual go back to the ranks
  as shards; once with the whole vector at once and once in chunks of ``--chunk-mib`` MiB
  (``exchange_chunk_mib``), the leader's chunk-sized temporaries reused from chunk to chunk;
- ``to owners`` and, with ``--codec``, ``round CODEC sliced``: the same for ``islands.exchange=sliced``
  (``CanonicalLayout.to_owners`` / ``from_owners``, an all-to-all that gives each rank its slice; then
  :func:`~lightning_islands.engine.sliced.exchange_sliced`, each rank encoding, decoding and merging
  its own slice in chunks of ``--chunk-mib``);
- with ``--codec``, ``..., overlapped`` and ``..., sliced, overlapped``: the chunked rounds flown in
  the background (``overlap_steps``: the leader's thread on the gathered fragment, or every rank's
  thread on a snapshot of its shards) and landed (the wait and the hand-over to the shards).

It reports how far each process's peak resident memory (``VmHWM``) rose above its level before the
round, in MiB and in full fp32 copies of the model, and each rank's wall time for the round. Linux only.

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

from lightning_islands.engine import CanonicalLayout, IslandEngine, IslandSettings, TorchGroup
from lightning_islands.engine.slice_moves import slice_bounds


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size


def _engine_round(layout: CanonicalLayout, locals_: list, codec: str, chunk_mib: float | None,
                  exchange: str = "leader", overlapped: bool = False) -> tuple[list, int]:
    """The first half of one round of the engine, a lone island (see the module docstring): the
    outer step's gradients, and the resident size before the round. ``overlapped``: the round flies
    in the background (the leader's thread, or with ``exchange="sliced"`` every rank's) and lands."""
    cpu = torch.device("cpu")
    settings = IslandSettings(codec=codec, error_feedback=True, exchange_chunk_mib=chunk_mib, exchange=exchange,
                              overlap_steps=1 if overlapped else 0)
    engine = IslandEngine(settings, layout, 0, 1, cpu, cpu)
    if overlapped:
        engine.flight_side()  # the second group of a sliced flight, made before the measurement
    engine.state.set_anchors([torch.add(loc, loc) for loc in locals_])  # anchor - local = the shards of locals_
    # last round's residual, sharded like the model: it persists between rounds (written: resident)
    engine.state.residual = [torch.zeros_like(loc) for loc in locals_]
    engine.schedule.round_steps = 1
    dist.barrier()
    _reset_peak()
    base = _peak_rss()
    if overlapped:
        pending = engine.start(locals_, background=True)
        engine._receive(pending)  # the landing's wait and hand-over, without the outer step
    else:
        pending = engine.start(locals_)
    assert pending.grads is not None
    return pending.grads, base


def _sliced_round(layout: CanonicalLayout, locals_: list, codec: str, chunk_mib: float) -> tuple[list, int]:
    """One round's sliced exchange of a lone island (no link): every rank its own slice."""
    from lightning_islands.engine.header import RoundHeader
    from lightning_islands.engine.island import Island
    from lightning_islands.engine.merging import MergePlan
    from lightning_islands.engine.sliced import exchange_sliced

    cpu, world = torch.device("cpu"), layout.group.size
    settings = IslandSettings(codec=codec, error_feedback=True, exchange_chunk_mib=chunk_mib, exchange="sliced")
    plan = MergePlan.of([RoundHeader(0, tokens=1.0, steps=1, norm=1.0, ranks=world)], "tokens", None, layout)
    residual = [torch.zeros_like(loc) for loc in locals_]
    dist.barrier()
    _reset_peak()
    base = _peak_rss()
    got = exchange_sliced(Island(0, 1, layout.group), layout, settings.make_codec(), None, plan, locals_, locals_,
                          residual, 1.0, world, settings.exchange_chunk, cpu, cpu)
    return got.grads, base


def _worker(rank: int, world: int, numel: int, mode: str, store: str, out: str, codec: str, chunk: float) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        names = [f"w{i}" for i in range(8)]  # 8 matrices of 1024 columns
        params = [distribute_tensor(torch.zeros(numel // 8 // 1024, 1024), mesh, [Shard(0)]) for _ in names]
        layout = CanonicalLayout.from_parameters(list(zip(names, params)), TorchGroup(torch.device("cpu")))
        locals_ = [p.to_local() + 1.0 for p in params]  # the round's pseudo-gradient shards
        cpu = torch.device("cpu")
        dist.barrier()
        _reset_peak()
        base = _peak_rss()
        t0 = time.perf_counter()
        if mode.endswith("overlapped"):
            grads, base = _engine_round(layout, locals_, codec, chunk, "sliced" if "sliced" in mode else "leader",
                                        overlapped=True)
            grads[0].reshape(-1)[:1] = 0.5
        elif mode.startswith("round") and mode.endswith("sliced"):
            grads, base = _sliced_round(layout, locals_, codec, chunk)
            grads[0].reshape(-1)[:1] = 0.5
        elif mode.startswith("round"):
            grads, base = _engine_round(layout, locals_, codec, chunk if "chunk" in mode else 0)
            grads[0].reshape(-1)[:1] = 0.5  # (the merged value itself depends on the codec)
        elif mode == "to owners":
            bounds = slice_bounds(layout.numel, world, 1)
            own = layout.to_owners(locals_, bounds, cpu)
            merged = own * 0.5 if own is not None else None
            own = None
            grads = layout.from_owners(merged, bounds, cpu, [torch.empty_like(loc) for loc in locals_])
        else:
            full = layout.gather_to_leader(locals_, cpu)
            merged = full * 0.5 if full is not None else None
            full = None  # as the round does once the leader has encoded it
            grads = layout.scatter_from_leader(merged, cpu)
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
    parser.add_argument("--modes", default=None,
                        help="comma-separated rows to run (default all): leader, owners, round, chunks, sliced, "
                             "overlapped, sliced-overlapped")
    args = parser.parse_args()
    chunk = args.chunk_mib
    named = {"leader": "to leader", "owners": "to owners"}
    if args.codec:
        named |= {"round": f"round {args.codec}", "chunks": f"round {args.codec}, chunks of {args.chunk_mib:g} MiB",
                  "sliced": f"round {args.codec}, chunks of {args.chunk_mib:g} MiB, sliced",
                  "overlapped": f"round {args.codec}, chunks of {args.chunk_mib:g} MiB, overlapped",
                  "sliced-overlapped": f"round {args.codec}, chunks of {args.chunk_mib:g} MiB, sliced, overlapped"}
    wanted = args.modes.split(",") if args.modes else list(named)
    unknown = [m for m in wanted if m not in named]
    if unknown:
        parser.error(f"--modes {args.modes}: unknown {unknown} (rows: {', '.join(named)}; round rows need --codec)")
    modes = [named[m] for m in wanted]
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
