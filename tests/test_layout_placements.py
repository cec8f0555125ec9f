"""The canonical layout of parameters placed in any way DTensor places them, ranks as threads.

Property-based over meshes (1-D and 2-D, ranks in any order), shapes (empty and uneven ones
included) and placements (``Shard`` on any dimension, strided shards, ``Replicate``, plain tensors):
the island's parts gather to the full vector and scatter back to each part exactly, replicated copies
count once, and the checksum does not depend on the layout. What each rank holds is what torch's own
split gives, mesh dimension by mesh dimension, as ``distribute_tensor`` places a tensor.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from doubles import ThreadGroup, ThreadIsland, run_threads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_islands.app.launch import free_port
from lightning_islands.engine import CanonicalLayout
from lightning_islands.engine.layout import Placing

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]



def truth(full: torch.Tensor, placing: Placing | bool, rank: int, world: int) -> torch.Tensor:
    """What ``rank`` holds of ``full``: DTensor's split, one mesh dimension after another."""
    if placing is False:
        return full
    if placing is True:
        placing = Placing(torch.arange(world), (Shard(0),))
    coord = (placing.mesh == rank).nonzero()[0].tolist()
    local = full
    for m, p in enumerate(placing.placements):
        if p.is_shard() or isinstance(p, _StridedShard):
            chunks = p._split_tensor(local, int(placing.mesh.shape[m]), with_padding=False)[0]
            local = chunks[coord[m]] if coord[m] < len(chunks) else local.narrow(p.dim, 0, 0)
    return local.contiguous()


@st.composite
def islands(draw):
    """(mesh ranks, [(name, shape, placing)]) of one island."""
    mesh_shape = draw(st.sampled_from([(1,), (2,), (3,), (4,), (2, 2), (1, 2), (2, 1), (3, 1)]))
    world = math.prod(mesh_shape)
    mesh = torch.tensor(draw(st.permutations(range(world)))).view(mesh_shape)
    params = []
    for k in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
        kind = draw(st.sampled_from(["dtensor", "dtensor", "dtensor", "plain", "fsdp"]))
        if kind == "plain" or not shape:
            placing: Placing | bool = False
        elif kind == "fsdp" and mesh_shape == (world,) and list(mesh.view(-1)) == list(range(world)):
            placing = True
        else:
            placements = []
            for _ in mesh_shape:
                d = draw(st.integers(0, len(shape) - 1))
                placements.append(draw(st.sampled_from([Replicate(), Shard(d), _StridedShard(d, split_factor=2),
                                                        _StridedShard(d, split_factor=3)])))
            placing = Placing(mesh, tuple(placements))
        params.append((f"p{k}", shape, placing))
    return world, params


def _run(world, params, body):
    shared = ThreadIsland(world)
    fulls = [torch.randn(shape, generator=torch.Generator().manual_seed(k)) for k, (_, shape, _) in enumerate(params)]

    def rank_main(rank):
        layout = CanonicalLayout(params, ThreadGroup(shared, rank))
        locals_ = [truth(f, placing, rank, world).clone() for f, (_, _, placing) in zip(fulls, params)]
        return body(rank, layout, locals_, fulls)

    return run_threads([lambda r=r: rank_main(r) for r in range(world)])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(islands(), st.lists(st.floats(0, 1), max_size=3))
def test_any_placement_gathers_to_the_full_vector_and_scatters_back_exactly(island, cuts):
    world, params = island

    def body(rank, layout, locals_, fulls):
        want = torch.cat([f.reshape(-1) for f in fulls])
        bounds = sorted({0, layout.numel, *(int(c * layout.numel) for c in cuts)})
        ranges = list(zip(bounds, bounds[1:]))
        layout.check_local_shapes([t.shape for t in locals_])
        full = layout.gather_to_leader(locals_, CPU)
        pieces = [layout.gather_to_leader(locals_, CPU, start=a, stop=b) for a, b in ranges]
        flat = torch.arange(layout.numel, dtype=torch.float32)
        shards = layout.scatter_from_leader(flat if rank == 0 else None, CPU)
        into = [torch.full(t.shape, -1.0) for t in locals_]
        for a, b in ranges:
            layout.scatter_from_leader(flat[a:b] if rank == 0 else None, CPU, start=a, stop=b, into=into)
        expect = [truth(flat[e.offset: e.offset + e.numel].view(e.shape), placing, rank, world)
                  for e, (_, _, placing) in zip(layout.entries, params)]
        for i, (s, x, m) in enumerate(zip(shards, into, expect)):
            assert s.shape == m.shape == layout.local_shape(i) and torch.equal(s, m), (rank, params[i])
            assert torch.equal(x, m) and torch.equal(layout.shard_of(flat, i), m), (rank, params[i])
        if rank == 0:
            assert torch.equal(full, want)
            assert torch.equal(torch.cat([p for p in pieces] or [want[:0]]), want)
        return layout.island_checksum(locals_), want

    results = _run(world, params, body)
    solo = CanonicalLayout([(n, s, False) for n, s, _ in params])
    whole = [results[0][1][e.offset: e.offset + e.numel].view(e.shape) for e in solo.entries]
    assert {checksum for checksum, _ in results} == {solo.checksum(whole)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(islands(), st.lists(st.floats(0, 1), min_size=1, max_size=4))
def test_any_placement_moves_each_range_to_its_owner_and_back_exactly(island, cuts):
    """The sliced exchange's all-to-all (``to_owners``/``from_owners``) over any mesh and placement:
    owner ``r`` receives exactly values ``bounds[r]`` of the canonical vector (empty ranges, and
    ranks past the ranges, receive nothing), and what the owners send back lands in every rank's
    shards exactly where it belongs, replicated copies included."""
    world, params = island

    def body(rank, layout, locals_, fulls):
        want = torch.cat([f.reshape(-1) for f in fulls])
        cut = sorted(int(c * layout.numel) for c in cuts)[: world - 1]
        edges = [0, *cut, layout.numel]
        bounds = list(zip(edges, edges[1:]))  # at most one range per rank, covering the vector; some may be empty
        got = layout.to_owners(locals_, bounds, CPU)
        mine = bounds[rank] if rank < len(bounds) else None
        if mine is None or mine[0] == mine[1]:
            assert got is None or got.numel() == 0, (rank, bounds)
        else:
            assert torch.equal(got, want[mine[0]:mine[1]]), (rank, bounds)
        flat = torch.arange(layout.numel, dtype=torch.float32)
        into = [torch.full(t.shape, -1.0) for t in locals_]
        back = None if mine is None or mine[0] == mine[1] else flat[mine[0]:mine[1]].clone()
        layout.from_owners(back, bounds, CPU, into)
        for i, (e, (_, _, placing)) in enumerate(zip(layout.entries, params)):
            assert torch.equal(into[i], truth(flat[e.offset: e.offset + e.numel].view(e.shape), placing, rank, world))
        return True

    assert all(_run(world, params, body))


def test_replicated_copies_are_gathered_once_and_scattered_to_every_holder():
    # a 2 x 2 mesh: "col" split along dim 0 over both mesh dims, "row" along dim 1 over the second
    # only (copies on the first), "norm" replicated everywhere, "bias" plain
    mesh = torch.arange(4).view(2, 2)
    params = [("col", (8, 3), Placing(mesh, (_StridedShard(0, split_factor=2), Shard(0)))),
              ("row", (3, 40), Placing(mesh, (Replicate(), Shard(1)))),
              ("norm", (5,), Placing(mesh, (Replicate(), Replicate()))), ("bias", (2,), False)]

    def body(rank, layout, locals_, fulls):
        return ([layout.owns(i) for i in range(len(params))], [layout.local_shape(i) for i in range(len(params))],
                layout.gather_to_leader(locals_, CPU))

    results = _run(4, params, body)
    assert [owns for owns, _, _ in results] == [[True, True, True, True], [True, True, False, False],
                                                [True, False, False, False], [True, False, False, False]]
    assert [shapes for _, shapes, _ in results][3] == [(2, 3), (3, 20), (5,), (2,)]
    # FSDP2 over tensor parallel: the second mesh dimension's rank t holds half t of the rows, the
    # first dimension's rank d the d-th half of that (rank 1 = (0, 1): rows 4, 5)
    rows = {r: (truth(torch.arange(8.0), params[0][2], r, 4).tolist(),
                layout_rows(params[0], r)) for r in range(4)}
    assert rows == {0: ([0.0, 1.0], [0, 1]), 1: ([4.0, 5.0], [4, 5]), 2: ([2.0, 3.0], [2, 3]), 3: ([6.0, 7.0], [6, 7])}


def layout_rows(param, rank):
    return list(param[2].held(param[1], rank)[0])


def test_parts_that_overlap_without_being_copies_are_refused():
    with pytest.raises(ValueError, match="exactly once"):
        CanonicalLayout([("w", (4, 2), False)], ThreadGroup(ThreadIsland(2), 0),
                        held=[[(torch.arange(3), torch.arange(2))], [(torch.arange(1, 4), torch.arange(2))]])


def test_real_dtensor_layouts_of_the_same_weights_meet_in_one_canonical_vector(tmp_path):
    out = tmp_path / "layouts.json"
    script = Path(__file__).parent / "scripts" / "layout_dtensor.py"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                          "--master-port", str(free_port()), str(script), str(out)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["tp+fsdp"]["placements"]["up.weight"] == ["_S(0, 2)", "S(0)"]
    assert results["tp+fsdp"]["placements"]["down.weight"] == ["S(0)", "S(1)"]
    assert results["tp"]["placements"]["norm.weight"] is None
    assert results["hsdp"]["placements"]["up.weight"] == ["R", "S(0)"]
    for kind, r in results.items():
        assert r["gathered"] and r["scattered"], kind
    assert len({r["checksum"] for r in results.values()}) == 1
    clip = results["tp+fsdp"]["clip"]  # gradients on the 2-D mesh and on the data-parallel sub-meshes
    assert clip["total"] == pytest.approx(clip["want"], rel=1e-5) and clip["total"] > 1 and clip["scaled"]
