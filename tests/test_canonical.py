"""The canonical layout's gather to and scatter from an island's leader, in a real 3-process gloo world."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_islands.canonical import CanonicalLayout

# rows that 3 ranks split unevenly: 7 -> 3, 3, 1; 5 -> 2, 2, 1; 4 -> 2, 2, 0; 1 -> 1, 0, 0
SHAPES = {"embed": (7, 3), "proj": (5, 2), "bias": (4,), "gate": (1, 6)}
WORLD = 3


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=g)


@contextlib.contextmanager
def _island(rank: int, store_path: str) -> Iterator[tuple]:
    """This rank of a 3-process gloo island (a hang fails after 30 s): ``(mesh, the SHAPES parameters
    sharded as FSDP2 shards them, their layout)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        params = [distribute_tensor(_full(n), mesh, [Shard(0)]) for n in SHAPES]
        yield mesh, params, CanonicalLayout(list(zip(SHAPES, params)))
    finally:
        dist.destroy_process_group()


def _worker(rank: int, store_path: str, out_path: str) -> None:
    with _island(rank, store_path) as (_, params, layout):
        cpu = torch.device("cpu")
        full = layout.gather_to_leader([p.to_local() for p in params], params, cpu)
        # the leader cuts a different vector back into every rank's shards
        flat = torch.arange(layout.numel, dtype=torch.float32) if rank == 0 else None
        shards = layout.scatter_from_leader(flat, params, cpu)
        expected = torch.arange(layout.numel, dtype=torch.float32)
        mine = [layout.shard_of(expected, i, p) for i, p in enumerate(params)]
        # ranks 1 and 2 hold nothing of this one-row parameter: no message is sent to or from them
        gate = params[list(SHAPES).index("gate")]
        small = CanonicalLayout([("gate", gate)])
        small_full = small.gather_to_leader([gate.to_local()], [gate], cpu)
        small_shards = small.scatter_from_leader(torch.ones(6) if rank == 0 else None, [gate], cpu)
        # in ranges that cut parameters and shards: the same values, a range at a time
        bounds = [(0, 5), (5, 17), (17, 18), (18, 29), (29, layout.numel)]
        ranged = [layout.gather_to_leader([p.to_local() for p in params], params, cpu, start=a, stop=b)
                  for a, b in bounds]
        into = [torch.full(p.to_local().shape, -1.0) for p in params]
        for a, b in bounds:
            layout.scatter_from_leader(flat[a:b] if rank == 0 else None, params, cpu, start=a, stop=b, into=into)
        result = {
            "ranged": None if rank else torch.cat(ranged),
            "ranged_scatter_ok": all(torch.equal(s, m) for s, m in zip(into, mine)),
            "small_full": small_full,
            "small_shard": small_shards[0],
            "full": full,
            "shapes": [tuple(s.shape) for s in shards],
            "local_shapes": [tuple(p.to_local().shape) for p in params],
            "scatter_ok": all(torch.equal(s, m) for s, m in zip(shards, mine)),
        }
        torch.save(result, f"{out_path}.{rank}")


def test_only_the_leader_gathers_the_full_vector_and_each_rank_gets_its_own_shards(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=WORLD)
    results = [torch.load(tmp_path / f"out.{r}", weights_only=False) for r in range(WORLD)]
    want = torch.cat([_full(n).reshape(-1) for n in SHAPES])
    assert torch.equal(results[0]["full"], want)
    assert torch.equal(results[0]["ranged"], want)
    assert all(r["ranged_scatter_ok"] for r in results)
    assert results[1]["full"] is None and results[2]["full"] is None
    # uneven and empty shards, as FSDP2 splits them
    assert [r["local_shapes"] for r in results] == [
        [(3, 3), (2, 2), (2,), (1, 6)],
        [(3, 3), (2, 2), (2,), (0, 6)],
        [(1, 3), (1, 2), (0,), (0, 6)],
    ]
    for r in results:
        assert r["shapes"] == r["local_shapes"]
        assert r["scatter_ok"]
    assert torch.equal(results[0]["small_full"], _full("gate").reshape(-1))
    assert results[1]["small_full"] is None and results[2]["small_full"] is None
    assert torch.equal(results[0]["small_shard"], torch.ones(1, 6))
    assert [tuple(r["small_shard"].shape) for r in results[1:]] == [(0, 6), (0, 6)]


def _mismatch_worker(rank: int, store_path: str, out_path: str) -> None:
    """Rank 2's shards do not follow FSDP2's split: every rank must raise, none may wait in send/recv."""
    from torch.distributed.tensor import DTensor, Shard

    with _island(rank, store_path) as (mesh, params, layout):
        cpu = torch.device("cpu")
        locals_ = [p.to_local() for p in params]
        if rank == 2:
            locals_[0] = locals_[0][:0]  # holds none of embed's row where the split gives it one
        errors = []
        try:
            layout.gather_to_leader(locals_, params, cpu)
        except RuntimeError as e:
            errors.append(str(e))
        # a parameter whose local shard is not the one the layout cuts for this rank
        embed = _full("embed")
        rows = {0: embed[:2], 1: embed[2:5], 2: embed[5:]}  # 2, 3, 2 rows, where torch.chunk gives 3, 3, 1
        odd = DTensor.from_local(rows[rank], mesh, [Shard(0)], run_check=False, shape=embed.shape,
                                 stride=embed.stride())
        odd_layout = CanonicalLayout([("embed", odd)])
        try:
            odd_layout.scatter_from_leader(torch.zeros(embed.numel()) if rank == 0 else None, [odd], cpu)
        except RuntimeError as e:
            errors.append(str(e))
        torch.save(errors, f"{out_path}.{rank}")


def test_a_rank_whose_shards_do_not_fit_the_layout_stops_every_rank_with_its_reason(tmp_path):
    mp.spawn(_mismatch_worker, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=WORLD)
    errors = [torch.load(tmp_path / f"out.{r}", weights_only=False) for r in range(WORLD)]
    for per_rank in errors:
        assert len(per_rank) == 2
        gather, scatter = per_rank
        assert "rank 2: holds 0 values of embed, the layout expects 3" in gather
        assert "rank 0: holds (2, 3) of embed, the layout gives it 9 values" in scatter
        assert "rank 2: holds (2, 3) of embed, the layout gives it 3 values" in scatter
        assert "fully_shard" in gather and "fully_shard" in scatter


def test_ranges_in_a_one_process_island_and_bad_ranges():
    params = [_full(n) for n in SHAPES]
    layout = CanonicalLayout(list(zip(SHAPES, params)))
    cpu = torch.device("cpu")
    want = torch.cat([p.reshape(-1) for p in params])
    assert torch.equal(layout.gather_to_leader(params, params, cpu, start=4, stop=40), want[4:40])
    into = [torch.zeros_like(p) for p in params]
    layout.scatter_from_leader(want[10:33], params, cpu, start=10, stop=33, into=into)
    got = torch.cat([t.reshape(-1) for t in into])
    assert torch.equal(got[10:33], want[10:33]) and not got[:10].any() and not got[33:].any()
    with pytest.raises(ValueError, match="needs `into`"):
        layout.scatter_from_leader(want[:5], params, cpu, start=0, stop=5)
    with pytest.raises(ValueError, match="outside"):
        layout.gather_to_leader(params, params, cpu, start=5, stop=layout.numel + 1)
    with pytest.raises(ValueError, match="holds 4 values"):
        layout.scatter_from_leader(want[:4], params, cpu, start=0, stop=5, into=into)
