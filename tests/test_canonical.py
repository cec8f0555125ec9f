"""The canonical layout's gather to and scatter from an island's leader, in a real 3-process gloo world."""

from __future__ import annotations

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


def _worker(rank: int, store_path: str, out_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        params = [distribute_tensor(_full(n), mesh, [Shard(0)]) for n in SHAPES]
        layout = CanonicalLayout(list(zip(SHAPES, params)))
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
        result = {
            "small_full": small_full,
            "small_shard": small_shards[0],
            "full": full,
            "shapes": [tuple(s.shape) for s in shards],
            "local_shapes": [tuple(p.to_local().shape) for p in params],
            "scatter_ok": all(torch.equal(s, m) for s, m in zip(shards, mine)),
        }
        torch.save(result, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


def test_only_the_leader_gathers_the_full_vector_and_each_rank_gets_its_own_shards(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=WORLD)
    results = [torch.load(tmp_path / f"out.{r}", weights_only=False) for r in range(WORLD)]
    want = torch.cat([_full(n).reshape(-1) for n in SHAPES])
    assert torch.equal(results[0]["full"], want)
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
