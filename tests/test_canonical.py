"""The canonical layout's gather to and scatter from an island's leader, ranks as threads of one test."""

from __future__ import annotations

import pytest
import torch
from doubles import ThreadGroup, ThreadIsland, run_threads

from lightning_islands.engine import CanonicalLayout

# rows that 3 ranks split unevenly: 7 -> 3, 3, 1; 5 -> 2, 2, 1; 4 -> 2, 2, 0; 1 -> 1, 0, 0; "norm": whole everywhere
SHAPES = {"embed": (7, 3), "proj": (5, 2), "bias": (4,), "gate": (1, 6), "norm": (3,)}
SPECS = [(n, s, n != "norm") for n, s in SHAPES.items()]
WORLD = 3
CPU = torch.device("cpu")


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=g)


def _ranks(body) -> list:
    """``body(rank, layout, locals_)`` on every rank of a 3-rank island; the results in rank order."""
    shared = ThreadIsland(WORLD)
    want = torch.cat([_full(n).reshape(-1) for n in SHAPES])

    def rank_main(rank: int):
        layout = CanonicalLayout(SPECS, ThreadGroup(shared, rank))
        locals_ = [layout.shard_of(want, i).clone() for i in range(len(SPECS))]
        return body(rank, layout, locals_)

    return run_threads([lambda r=r: rank_main(r) for r in range(WORLD)])


def test_only_the_leader_gathers_the_full_vector_and_each_rank_gets_its_own_shards():
    want = torch.cat([_full(n).reshape(-1) for n in SHAPES])
    bounds = [(0, 5), (5, 17), (17, 18), (18, 29), (29, want.numel())]  # ranges that cut parameters and shards

    def body(rank, layout, locals_):
        full = layout.gather_to_leader(locals_, CPU)
        ranged = [layout.gather_to_leader(locals_, CPU, start=a, stop=b) for a, b in bounds]
        flat = torch.arange(layout.numel, dtype=torch.float32)
        shards = layout.scatter_from_leader(flat if rank == 0 else None, CPU)
        into = [torch.full(t.shape, -1.0) for t in locals_]
        for a, b in bounds:
            layout.scatter_from_leader(flat[a:b] if rank == 0 else None, CPU, start=a, stop=b, into=into)
        mine = [layout.shard_of(flat, i) for i in range(len(SPECS))]
        return {"full": full, "ranged": None if rank else torch.cat(ranged),
                "local_shapes": [tuple(t.shape) for t in locals_], "shapes": [tuple(t.shape) for t in shards],
                "scatter_ok": all(torch.equal(s, m) for s, m in zip(shards, mine)),
                "ranged_scatter_ok": all(torch.equal(s, m) for s, m in zip(into, mine))}

    results = _ranks(body)
    assert torch.equal(results[0]["full"], want) and torch.equal(results[0]["ranged"], want)
    assert results[1]["full"] is None and results[2]["full"] is None
    # uneven and empty shards, as FSDP2 splits them; the plain tensor whole everywhere
    assert [r["local_shapes"] for r in results] == [
        [(3, 3), (2, 2), (2,), (1, 6), (3,)],
        [(3, 3), (2, 2), (2,), (0, 6), (3,)],
        [(1, 3), (1, 2), (0,), (0, 6), (3,)],
    ]
    for r in results:
        assert r["shapes"] == r["local_shapes"] and r["scatter_ok"] and r["ranged_scatter_ok"]


def test_a_rank_whose_shards_do_not_fit_the_layout_stops_every_rank_with_its_reason():
    def body(rank, layout, locals_):
        errors = []
        if rank == 2:
            locals_[0] = locals_[0][:0]  # holds none of embed's row where the split gives it one
        try:
            layout.gather_to_leader(locals_, CPU)
        except RuntimeError as e:
            errors.append(str(e))
        held = {0: (2, 3), 1: (3, 3), 2: (2, 3)}[rank]  # 2, 3, 2 rows of embed, where torch.chunk gives 3, 3, 1
        try:
            layout.check_local_shapes([held, *[t.shape for t in locals_[1:]]])
        except RuntimeError as e:
            errors.append(str(e))
        return errors

    for gather, shapes in _ranks(body):
        assert "rank 2: holds 0 values of embed, the layout expects 3" in gather
        assert "rank 0: holds (2, 3) of embed, the layout gives it (3, 3)" in shapes
        assert "rank 2: holds (2, 3) of embed, the layout gives it (1, 3)" in shapes
        assert "rank 1" not in shapes
        assert "fully_shard" in gather and "fully_shard" in shapes


def test_ranges_in_a_one_process_island_and_bad_ranges():
    params = [_full(n) for n in SHAPES]
    layout = CanonicalLayout.from_parameters(list(zip(SHAPES, params)))
    want = torch.cat([p.reshape(-1) for p in params])
    assert torch.equal(layout.gather_to_leader(params, CPU, start=4, stop=40), want[4:40])
    into = [torch.zeros_like(p) for p in params]
    layout.scatter_from_leader(want[10:33], CPU, start=10, stop=33, into=into)
    got = torch.cat([t.reshape(-1) for t in into])
    assert torch.equal(got[10:33], want[10:33]) and not got[:10].any() and not got[33:].any()
    with pytest.raises(ValueError, match="needs `into`"):
        layout.scatter_from_leader(want[:5], CPU, start=0, stop=5)
    with pytest.raises(ValueError, match="outside"):
        layout.gather_to_leader(params, CPU, start=5, stop=layout.numel + 1)
    with pytest.raises(ValueError, match="holds 4 values"):
        layout.scatter_from_leader(want[:4], CPU, start=0, stop=5, into=into)

