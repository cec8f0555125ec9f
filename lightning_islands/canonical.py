"""The canonical layout: every parameter's full tensor, flattened, concatenated in module order.

Islands shard the same parameters differently (2 ranks here, 1 there). They meet in this layout:
gather the local shards of the island into the full flat vector, and cut the island's own shards
back out of a full flat vector. Each round's exchange gathers to the island's leader and scatters
from it (:meth:`CanonicalLayout.gather_to_leader`, :meth:`CanonicalLayout.scatter_from_leader`), a
range of the flat vector at a time, so that only the leader holds values beyond its own shards,
and only those of the range. Only torch.distributed and DTensor plumbing
lives here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
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

    def _pieces(self, params: Sequence[Tensor], world: int, replicated_to_all: bool) -> list[list[tuple[int, int]]]:
        """Per rank of the island, the ``(flat offset, numel)`` of what it holds of each parameter, in
        parameter order. A DTensor is split along dim 0 as FSDP2 splits it (``torch.chunk``: equal
        chunks of ``ceil(rows / world)`` rows, the last ones shorter or empty); a plain tensor is
        whole on every rank (``replicated_to_all``) or counted once, on rank 0."""
        from torch.distributed.tensor import DTensor

        pieces: list[list[tuple[int, int]]] = [[] for _ in range(world)]
        for e, p in zip(self.entries, params):
            if not isinstance(p, DTensor):
                for r in range(world if replicated_to_all else 1):
                    pieces[r].append((e.offset, e.numel))
                continue
            self._check_placement(e, p)
            rows = e.shape[0] if e.shape else 1
            per_row = e.numel // rows if rows else 0
            chunk = -(-rows // world) if rows else 0
            for r in range(world):
                start, stop = min(r * chunk, rows), min((r + 1) * chunk, rows)
                pieces[r].append((e.offset + start * per_row, (stop - start) * per_row))
        return pieces

    @staticmethod
    def _check_placement(e: Entry, param: Tensor) -> None:
        from torch.distributed.tensor import Shard

        placements = tuple(param.placements)  # type: ignore[attr-defined]
        if placements != (Shard(0),):
            raise NotImplementedError(
                f"parameter {e.name} is placed as {placements}; islands support FSDP2's Shard(0) over a "
                "1-D mesh (no tensor parallelism inside an island yet)"
            )

    @staticmethod
    def _agree(problem: str | None, device: torch.device) -> None:
        """Raise on every rank of the island if any rank found ``problem`` (None: this rank's shards
        fit the layout). Called before the point-to-point transfers: a rank that raised alone would
        leave the others waiting in send/recv until the process group timed out."""
        flag = torch.tensor([0 if problem is None else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag.item()):
            return
        problems: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        found = "; ".join(f"rank {r}: {text}" for r, text in enumerate(problems) if text)
        raise RuntimeError(
            f"the island's shards do not follow the canonical layout ({found}). Islands expect FSDP2's "
            "Shard(0) split of every parameter (torch.chunk along dim 0 over the island's ranks); "
            "shard the module with fully_shard's default placement"
        )

    @staticmethod
    def _transfer_device(device: torch.device) -> torch.device:
        """Where the point-to-point buffers live: ``device``, except on the host for gloo, whose
        send and recv take CPU tensors only (an island that trains on GPUs over gloo)."""
        return torch.device("cpu") if dist.get_backend() == "gloo" else device

    def _range(self, start: int, stop: int | None) -> tuple[int, int]:
        stop = self.numel if stop is None else stop
        if not 0 <= start <= stop <= self.numel:
            raise ValueError(f"range [{start}, {stop}) is outside the flat vector of {self.numel} values")
        return start, stop

    @staticmethod
    def _clip(pieces: Sequence[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int, int, int]]:
        """The parts of one rank's pieces inside ``[start, stop)``: ``(piece index, offset into the
        piece, offset into the range, numel)`` each, in order."""
        out = []
        for i, (offset, n) in enumerate(pieces):
            a, b = max(offset, start), min(offset + n, stop)
            if a < b:
                out.append((i, a - offset, a - start, b - a))
        return out

    def gather_to_leader(self, locals_: Sequence[Tensor], params: Sequence[Tensor], device: torch.device,
                         out_device: torch.device | None = None, start: int = 0,
                         stop: int | None = None, into: Tensor | None = None) -> Tensor | None:
        """The fp32 values ``[start, stop)`` (default: all) of the flat vector on the island's rank 0
        (on ``out_device``, default ``device``), ``None`` on the other ranks, which send only their
        shards' values in the range: one flat buffer each, on ``device`` (the GPU for NCCL),
        received by the leader one rank at a time into a reused buffer, so the leader holds the
        range and one rank's part of it at most. ``into`` (leader, optional): a flat fp32 tensor of
        ``stop - start`` values on ``out_device`` to gather into and return, instead of a new one.
        A collective inside the island: every rank must call it, with the same range."""
        start, stop = self._range(start, stop)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        pieces = self._pieces(params, world, replicated_to_all=False)
        out_device, device = out_device or device, self._transfer_device(device) if world > 1 else device
        # what this rank holds, piece by piece: (parameter index, local tensor); rank 0 alone sends a plain tensor
        held = [(i, local) for i, (local, p) in enumerate(zip(locals_, params)) if self.is_sharded(p) or rank == 0]
        if world > 1:
            self._agree(next((f"holds {local.numel()} values of {self.entries[i].name}, the layout expects {n}"
                              for (i, local), (_, n) in zip(held, pieces[rank]) if local.numel() != n), None), device)
        parts = [self._clip(ps, start, stop) for ps in pieces]
        sizes = [sum(n for *_, n in ps) for ps in parts]
        if rank != 0:
            mine = torch.empty(sizes[rank], dtype=torch.float32, device=device)
            at = 0
            for k, local_at, _, n in parts[rank]:
                mine[at : at + n].copy_(held[k][1].reshape(-1)[local_at : local_at + n])
                at += n
            if sizes[rank]:  # every rank knows every size: nothing is sent for empty parts
                dist.send(mine, dst=0)
            return None
        if into is not None and (into.numel() != stop - start or into.dtype != torch.float32):
            raise ValueError(f"into holds {into.numel()} {into.dtype} values for the range [{start}, {stop})")
        full = torch.empty(stop - start, dtype=torch.float32, device=out_device) if into is None else into
        for k, local_at, range_at, n in parts[0]:  # the leader's own part, straight into place
            full[range_at : range_at + n].copy_(held[k][1].reshape(-1)[local_at : local_at + n])
        buf = torch.empty(max(sizes[1:], default=0), dtype=torch.float32, device=device)
        for r in range(1, world):
            if not sizes[r]:
                continue
            src = buf[: sizes[r]]
            dist.recv(src, src=r)
            at = 0
            for _, _, range_at, n in parts[r]:
                full[range_at : range_at + n].copy_(src[at : at + n])
                at += n
        return full

    @staticmethod
    def is_sharded(param: Tensor) -> bool:
        """Whether ``param`` is split over the island's ranks (a DTensor); a plain tensor is whole on
        every rank."""
        from torch.distributed.tensor import DTensor

        return isinstance(param, DTensor)

    def scatter_from_leader(self, flat: Tensor | None, params: Sequence[Tensor], device: torch.device,
                            start: int = 0, stop: int | None = None,
                            into: Sequence[Tensor] | None = None) -> list[Tensor]:
        """This rank's part of each parameter (shaped like its local shard, fp32, on ``device``; on
        the host over gloo) cut from the values ``[start, stop)`` (default: all) of the flat vector,
        ``flat``, that only the island's rank 0 holds (``None`` elsewhere). The leader sends each
        rank only its own part, one rank at a time from a reused buffer.

        ``into``: tensors shaped like this rank's shards (any device and float dtype) to write the
        range's values into, the rest left as it is; they are returned instead. Needed for a
        partial range. A collective inside the island:
        every rank must call it, with the same range."""
        start, stop = self._range(start, stop)
        if into is None and (start, stop) != (0, self.numel):
            raise ValueError("scatter_from_leader of a partial range needs `into`, the tensors to fill")
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        if world == 1 and into is None:
            assert flat is not None
            return [self.shard_of(flat.to(device), i, p) for i, p in enumerate(params)]
        from torch.distributed.tensor import DTensor

        pieces = self._pieces(params, world, replicated_to_all=True)
        device = self._transfer_device(device) if world > 1 else device
        shapes = [tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape) for p in params]
        if world > 1:
            self._agree(next((f"holds {shape} of {e.name}, the layout gives it {n} values"
                              for e, shape, (_, n) in zip(self.entries, shapes, pieces[rank])
                              if torch.Size(shape).numel() != n), None), device)
        parts = [self._clip(ps, start, stop) for ps in pieces]
        sizes = [sum(n for *_, n in ps) for ps in parts]
        mine = torch.empty(sizes[rank], dtype=torch.float32, device=device)
        if rank == 0:
            assert flat is not None
            if flat.numel() != stop - start:
                raise ValueError(f"flat holds {flat.numel()} values for the range [{start}, {stop})")
            buf = torch.empty(max(sizes), dtype=torch.float32, device=device)
            for r in [*range(1, world), 0]:  # the leader's own part last, straight into ``mine``
                dst = mine if r == 0 else buf[: sizes[r]]
                at = 0
                for _, _, range_at, n in parts[r]:
                    dst[at : at + n].copy_(flat[range_at : range_at + n])
                    at += n
                if r and sizes[r]:
                    dist.send(dst, dst=r)
        elif sizes[rank]:
            dist.recv(mine, src=0)
        if into is None:  # the whole range: every piece, in order, is one view of ``mine``
            out, at = [], 0
            for shape, (_, n) in zip(shapes, pieces[rank]):
                out.append(mine[at : at + n].view(shape))
                at += n
            return out
        at = 0
        for k, local_at, _, n in parts[rank]:
            into[k].view(-1)[local_at : local_at + n].copy_(mine[at : at + n])
            at += n
        return list(into)

    def shard_of(self, flat: Tensor, index: int, param: Tensor) -> Tensor:
        """This rank's shard of parameter ``index`` cut out of the full flat vector."""
        from torch.distributed.tensor import DTensor

        e = self.entries[index]
        full = flat[e.offset : e.offset + e.numel].view(e.shape)
        if not isinstance(param, DTensor):
            return full
        self._check_placement(e, param)
        mesh = param.device_mesh
        chunks = torch.chunk(full, mesh.size(), dim=0)
        rank = mesh.get_local_rank()
        shard = chunks[rank] if rank < len(chunks) else full[0:0]
        expected = tuple(param.to_local().shape)
        if tuple(shard.shape) != expected:
            raise RuntimeError(f"shard of {e.name} has shape {tuple(shard.shape)}, FSDP2 holds {expected}")
        return shard
