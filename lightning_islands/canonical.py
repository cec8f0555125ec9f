"""The canonical layout: every parameter's full tensor, flattened, concatenated in module order.

Islands shard the same parameters differently (2 ranks here, 1 there). They meet in this layout:
gather the local shards of the island into the full flat vector, and cut the island's own shards
back out of a full flat vector. Only torch.distributed and DTensor plumbing lives here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Entry:
    """One parameter's place in the flat vector."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


class CanonicalLayout:
    """Offsets of named parameters in the flat vector, and the gather/scatter between it and shards."""

    def __init__(self, named_params: Sequence[tuple[str, Tensor]]) -> None:
        entries, offset = [], 0
        for name, p in named_params:
            numel = p.numel()
            entries.append(Entry(name, tuple(p.shape), offset, numel))
            offset += numel
        self.entries: list[Entry] = entries
        self.numel = offset

    def describe(self) -> list[list]:
        """``[name, shape]`` pairs, the model part of a rendezvous fingerprint."""
        return [[e.name, list(e.shape)] for e in self.entries]

    def gather(self, locals_: Sequence[Tensor], params: Sequence[Tensor]) -> Tensor:
        """Full fp32 flat vector from this rank's shards (``locals_[i]`` shaped like the shard of
        ``params[i]``). A collective inside the island: every rank must call it; every rank gets it."""
        from torch.distributed.tensor import DTensor

        parts = []
        for local, p in zip(locals_, params):
            if isinstance(p, DTensor):
                full = DTensor.from_local(
                    local.to(p.device), p.device_mesh, p.placements, run_check=False,
                    shape=p.shape, stride=p.stride(),
                ).full_tensor()
            else:
                full = local
            parts.append(full.reshape(-1).to(torch.float32))
        if not parts:
            return torch.empty(0, dtype=torch.float32)
        return torch.cat([t.to(parts[0].device) for t in parts])

    def shard_of(self, flat: Tensor, index: int, param: Tensor) -> Tensor:
        """This rank's shard of parameter ``index`` cut out of the full flat vector."""
        from torch.distributed.tensor import DTensor, Shard

        e = self.entries[index]
        full = flat[e.offset : e.offset + e.numel].view(e.shape)
        if not isinstance(param, DTensor):
            return full
        placements = tuple(param.placements)
        if placements != (Shard(0),):
            raise NotImplementedError(
                f"parameter {e.name} is placed as {placements}; islands support FSDP2's Shard(0) over a "
                "1-D mesh (no tensor parallelism inside an island yet)"
            )
        mesh = param.device_mesh
        chunks = torch.chunk(full, mesh.size(), dim=0)
        rank = mesh.get_local_rank()
        shard = chunks[rank] if rank < len(chunks) else full[0:0]
        expected = tuple(param.to_local().shape)
        if tuple(shard.shape) != expected:
            raise RuntimeError(f"shard of {e.name} has shape {tuple(shard.shape)}, FSDP2 holds {expected}")
        return shard
