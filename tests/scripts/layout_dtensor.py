"""One rank of a 4-process world (tests/test_layout_placements.py): the canonical layout of the same
weights under real DTensor layouts (FSDP2; tensor parallel; tensor parallel under FSDP2 on a 2 x 2
mesh; tensor parallel on sub-meshes, copies across them). ``torchrun --nproc-per-node 4
layout_dtensor.py OUT``; hybrid sharding too; rank 0 writes OUT (JSON): per layout, whether the leader's gathered vector
is the parameters' full tensors, whether the scattered vector is what DTensor holds, the checksum,
and each parameter's placements."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

from lightning_islands.startup import startup_imports

# torch: a fifth less CPU at start (see lightning_islands.startup)
with startup_imports(main=__name__ == "__main__"):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_islands.engine import CanonicalLayout, TorchGroup
    from lightning_islands.fsdp import destroy_world_at_exit
    from lightning_islands.fsdp_policy import clip_grad_norm_across_meshes


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 6)
        self.up = nn.Linear(6, 14, bias=False)  # 14 rows over 4 ranks: uneven shards
        self.down = nn.Linear(14, 6)
        self.norm = nn.RMSNorm(6)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(self.up(self.emb(idx)))).square().sum()


def tp(net: Net, mesh) -> None:
    parallelize_module(net, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def build(kind: str) -> Net:
    net = Net()
    if kind == "fsdp":
        fully_shard(net, mesh=init_device_mesh("cpu", (4,)))
    elif kind == "tp":
        tp(net, init_device_mesh("cpu", (4,)))
    elif kind == "tp+fsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp(net, mesh["tp"])
        fully_shard(net, mesh=mesh["dp"])
    elif kind == "hsdp":  # hybrid sharding: replicated over the first mesh dimension, sharded over the second
        fully_shard(net, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    elif kind == "tp copies":  # two tensor-parallel groups holding the same values, no FSDP
        tp(net, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"])
    return net


def clip(net: Net) -> dict:
    """Clip the gradients of the step just taken to norm 1 across the meshes: the total
    norm against one computed from the full gradients (each counted once), and whether every
    gradient was scaled by 1 / total."""
    fulls = {n: p.grad.full_tensor().clone() for n, p in net.named_parameters()}
    want = torch.sqrt(sum(g.square().sum() for g in fulls.values()))
    total = clip_grad_norm_across_meshes(list(net.parameters()), 1.0)
    scaled = all(torch.allclose(p.grad.full_tensor(), fulls[n] / (total + 1e-6)) for n, p in net.named_parameters())
    return {"total": float(total), "want": float(want), "scaled": scaled}


dist.init_process_group("gloo", timeout=timedelta(seconds=60))
destroy_world_at_exit()
rank = dist.get_rank()
results = {}
for kind in ("plain", "fsdp", "tp", "tp+fsdp", "hsdp", "tp copies"):
    net = build(kind)
    if kind == "tp+fsdp":
        net(torch.arange(10).view(2, 5) % (3 + rank // 2)).backward()  # each data-parallel rank its own tokens
    named = list(net.named_parameters())
    fulls = [p.full_tensor() if isinstance(p, DTensor) else p.detach() for _, p in named]
    locals_ = [p.to_local().detach() if isinstance(p, DTensor) else p.detach() for _, p in named]
    layout = CanonicalLayout.from_parameters(named, TorchGroup(torch.device("cpu")))
    got = layout.gather_to_leader(locals_, torch.device("cpu"))
    want = torch.cat([f.reshape(-1) for f in fulls])
    flat = torch.arange(layout.numel, dtype=torch.float32)
    parts = layout.scatter_from_leader(flat if rank == 0 else None, torch.device("cpu"))
    with torch.no_grad():
        for (_, p), part in zip(named, parts):
            (p.to_local() if isinstance(p, DTensor) else p).copy_(part)
    after = torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p.detach()).reshape(-1) for _, p in named])
    bad = torch.tensor([int(not torch.equal(after, flat))])
    dist.all_reduce(bad)
    results[kind] = {"gathered": bool(torch.equal(got, want)) if rank == 0 else None, "scattered": int(bad) == 0,
                     "checksum": layout.island_checksum(locals_), "clip": clip(net) if kind == "tp+fsdp" else None,
                     "placements": {n: [str(x) for x in p.placements] if isinstance(p, DTensor) else None
                                    for n, p in named}}
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
