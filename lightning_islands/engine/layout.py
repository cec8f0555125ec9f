"""The canonical layout: every parameter's full tensor, flattened, concatenated in module order.

Islands shard the same parameters differently (2 ranks here, 1 there). They meet in this layout:
each round gathers the island's local shards to its leader and scatters from it
(:meth:`CanonicalLayout.gather_to_leader`, :meth:`CanonicalLayout.scatter_from_leader`), a range of
the flat vector at a time, so that only the leader holds values beyond its own shards, and only
those of the range. A sharded parameter is split along dim 0 as FSDP2 splits it (``torch.chunk``
over the island's ranks); a plain one is whole on every rank. The ranks talk through an
:class:`~lightning_islands.engine.group.IslandGroup`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_islands.engine.group import IslandGroup, SoloGroup

_SHARD_FIX = ("Islands expect FSDP2's Shard(0) split of every parameter (torch.chunk along dim 0 over the "
              "island's ranks); shard the module with fully_shard's default placement")


_MIX = 2_654_435_761  # Knuth's multiplicative hash constant: the checksum's weights are MIX * index + 1


@dataclass(frozen=True)
class Entry:
    """One parameter's place in the flat vector, and whether the island's ranks split it."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    sharded: bool = False


class CanonicalLayout:
    """Offsets of named parameters in the flat vector, and the gather/scatter between it and shards.

    Args:
        params: ``(name, full shape, sharded)`` per parameter, in module order.
        group: the island's ranks (default: an island of one process).
    """

    def __init__(self, params: Sequence[tuple[str, Sequence[int], bool]], group: IslandGroup | None = None) -> None:
        entries, offset = [], 0
        for name, shape, sharded in params:
            numel = 1
            for d in shape:
                numel *= int(d)
            entries.append(Entry(name, tuple(int(d) for d in shape), offset, numel, bool(sharded)))
            offset += numel
        self.entries: list[Entry] = entries
        self.numel = offset
        self.group: IslandGroup = group if group is not None else SoloGroup()
        self._pieces_cache: dict[bool, list[list[tuple[int, int]]]] = {}

    @classmethod
    def from_parameters(cls, named: Sequence[tuple[str, Tensor]], group: IslandGroup | None = None
                        ) -> CanonicalLayout:
        """The layout of a module's parameters (plain tensors, or FSDP2's DTensors sharded
        ``Shard(0)`` over a 1-D mesh of the island). A collective of the island: every rank checks
        that its shards are the ones the layout cuts for it, and all raise if any rank's are not."""
        from torch.distributed.tensor import DTensor, Shard

        for name, p in named:
            if isinstance(p, DTensor) and tuple(p.placements) != (Shard(0),):
                raise NotImplementedError(
                    f"parameter {name} is placed as {tuple(p.placements)}; islands support FSDP2's Shard(0) "
                    "over a 1-D mesh (no tensor parallelism inside an island yet)")
        layout = cls([(n, tuple(p.shape), isinstance(p, DTensor)) for n, p in named], group)
        layout.check_local_shapes([tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)
                                   for _, p in named])
        return layout

    def subset(self, indices: Sequence[int]) -> CanonicalLayout:
        """The layout of the parameters ``indices`` alone (a fragment), over the same ranks."""
        return CanonicalLayout([(self.entries[i].name, self.entries[i].shape, self.entries[i].sharded)
                                for i in indices], self.group)

    def check_local_shapes(self, held: Sequence[Sequence[int]]) -> None:
        """Raise on every rank of the island unless every rank holds, of each parameter, the shape
        the layout cuts for it (``held``: this rank's shapes, in parameter order); a collective."""
        self._agree(next((f"holds {tuple(shape)} of {e.name}, the layout gives it {self.local_shape(i)}"
                          for i, (e, shape) in enumerate(zip(self.entries, held))
                          if tuple(shape) != self.local_shape(i)), None))

    def describe(self) -> list[list]:
        """``[name, shape]`` pairs, the model part of a rendezvous fingerprint."""
        return [[e.name, list(e.shape)] for e in self.entries]

    def is_sharded(self, index: int) -> bool:
        """Whether parameter ``index`` is split over the island's ranks (else whole on every rank)."""
        return self.entries[index].sharded

    def local_shape(self, index: int, rank: int | None = None) -> tuple[int, ...]:
        """The shape of ``rank``'s (default: this rank's) part of parameter ``index``."""
        e = self.entries[index]
        if not e.sharded or not e.shape:
            return e.shape
        start, stop = self._rows(e, self.group.rank if rank is None else rank)
        return (stop - start, *e.shape[1:])

    def _rows(self, e: Entry, rank: int) -> tuple[int, int]:
        """The rows ``[start, stop)`` of sharded parameter ``e`` that ``rank`` holds: FSDP2's split
        along dim 0 (``torch.chunk``: chunks of ``ceil(rows / world)`` rows, the last ones shorter
        or empty)."""
        rows = e.shape[0] if e.shape else 1
        chunk = -(-rows // self.group.size) if rows else 0
        return min(rank * chunk, rows), min((rank + 1) * chunk, rows)

    def _pieces(self, replicated_to_all: bool) -> list[list[tuple[int, int]]]:
        """Per rank of the island, the ``(flat offset, numel)`` of what it holds of each parameter, in
        parameter order. A sharded parameter is split along dim 0 as FSDP2 splits it (:meth:`_rows`);
        a plain one is whole on every rank (``replicated_to_all``) or counted once, on rank 0."""
        if replicated_to_all in self._pieces_cache:
            return self._pieces_cache[replicated_to_all]
        world = self.group.size
        pieces: list[list[tuple[int, int]]] = [[] for _ in range(world)]
        for e in self.entries:
            if not e.sharded:
                for r in range(world if replicated_to_all else 1):
                    pieces[r].append((e.offset, e.numel))
                continue
            rows = e.shape[0] if e.shape else 1
            per_row = e.numel // rows if rows else 0
            for r in range(world):
                start, stop = self._rows(e, r)
                pieces[r].append((e.offset + start * per_row, (stop - start) * per_row))
        self._pieces_cache[replicated_to_all] = pieces
        return pieces

    def _agree(self, problem: str | None) -> None:
        """Raise on every rank of the island if any rank found ``problem`` (None: this rank's shards
        fit the layout). Called before the point-to-point transfers: a rank that raised alone would
        leave the others waiting in send/recv until the process group timed out."""
        if self.group.size == 1:
            if problem is not None:
                raise RuntimeError(f"the island's shards do not follow the canonical layout (rank 0: {problem}). "
                                   + _SHARD_FIX)
            return
        if not self.group.max_int(0 if problem is None else 1):
            return
        problems = self.group.all_gather_object(problem)
        found = "; ".join(f"rank {r}: {text}" for r, text in enumerate(problems) if text)
        raise RuntimeError(f"the island's shards do not follow the canonical layout ({found}). " + _SHARD_FIX)

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

    def gather_to_leader(self, locals_: Sequence[Tensor], device: torch.device,
                         out_device: torch.device | None = None, start: int = 0,
                         stop: int | None = None, into: Tensor | None = None) -> Tensor | None:
        """The fp32 values ``[start, stop)`` (default: all) of the flat vector on the island's rank 0
        (on ``out_device``, default ``device``), ``None`` on the other ranks, which send only their
        shards' values in the range (``locals_[i]``: this rank's part of parameter ``i``): one flat
        buffer each, on ``device`` (the GPU for NCCL), received by the leader one rank at a time into
        a reused buffer, so the leader holds the range and one rank's part of it at most. ``into``
        (leader, optional): a flat fp32 tensor of ``stop - start`` values on ``out_device`` to gather
        into and return, instead of a new one. A collective inside the island: every rank must call
        it, with the same range."""
        start, stop = self._range(start, stop)
        world, rank = self.group.size, self.group.rank
        pieces = self._pieces(replicated_to_all=False)
        out_device, device = out_device or device, self.group.transfer_device(device) if world > 1 else device
        # what this rank holds, piece by piece: (parameter index, local tensor); rank 0 alone sends a plain tensor
        held = [(i, local) for i, (local, e) in enumerate(zip(locals_, self.entries)) if e.sharded or rank == 0]
        if world > 1:
            self._agree(next((f"holds {local.numel()} values of {self.entries[i].name}, the layout expects {n}"
                              for (i, local), (_, n) in zip(held, pieces[rank]) if local.numel() != n), None))
        parts = [self._clip(ps, start, stop) for ps in pieces]
        sizes = [sum(n for *_, n in ps) for ps in parts]
        if rank != 0:
            mine = torch.empty(sizes[rank], dtype=torch.float32, device=device)
            at = 0
            for k, local_at, _, n in parts[rank]:
                mine[at : at + n].copy_(held[k][1].reshape(-1)[local_at : local_at + n])
                at += n
            if sizes[rank]:  # every rank knows every size: nothing is sent for empty parts
                self.group.send(mine, 0)
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
            self.group.recv(src, r)
            at = 0
            for _, _, range_at, n in parts[r]:
                full[range_at : range_at + n].copy_(src[at : at + n])
                at += n
        return full

    def scatter_from_leader(self, flat: Tensor | None, device: torch.device, start: int = 0,
                            stop: int | None = None, into: Sequence[Tensor] | None = None) -> list[Tensor]:
        """This rank's part of each parameter (shaped like its local shard, fp32, on ``device``; on
        the host over gloo) cut from the values ``[start, stop)`` (default: all) of the flat vector,
        ``flat``, that only the island's rank 0 holds (``None`` elsewhere). The leader sends each
        rank only its own part, one rank at a time from a reused buffer.

        ``into``: tensors shaped like this rank's shards (any device and float dtype) to write the
        range's values into, the rest left as it is; they are returned instead. Needed for a
        partial range. A collective inside the island: every rank must call it, with the same range."""
        start, stop = self._range(start, stop)
        if into is None and (start, stop) != (0, self.numel):
            raise ValueError("scatter_from_leader of a partial range needs `into`, the tensors to fill")
        world, rank = self.group.size, self.group.rank
        if world == 1 and into is None:
            assert flat is not None
            return [self.shard_of(flat.to(device), i) for i in range(len(self.entries))]
        pieces = self._pieces(replicated_to_all=True)
        device = self.group.transfer_device(device) if world > 1 else device
        if into is not None and world > 1:
            self._agree(next((f"holds {tuple(t.shape)} of {e.name}, the layout gives it {n} values"
                              for e, t, (_, n) in zip(self.entries, into, pieces[rank]) if t.numel() != n), None))
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
                    self.group.send(dst, r)
        elif sizes[rank]:
            self.group.recv(mine, 0)
        if into is None:  # the whole range: every piece, in order, is one view of ``mine``
            out, at = [], 0
            for i, (_, n) in enumerate(pieces[rank]):
                out.append(mine[at : at + n].view(self.local_shape(i)))
                at += n
            return out
        at = 0
        for k, local_at, _, n in parts[rank]:
            into[k].view(-1)[local_at : local_at + n].copy_(mine[at : at + n])
            at += n
        return list(into)

    def checksum(self, tensors: Sequence[Tensor]) -> int:
        """A checksum of fp32 tensors shaped like this rank's shards (the anchors, the momentum) that
        depends only on the canonical vector's bits, not on how the island shards it: each value's
        bits times an odd number made from its canonical index, summed modulo 2^64 (int64 arithmetic
        wraps), so the island's sum over its ranks (:meth:`island_checksum`) is the same on every
        island that holds the same global state. For spotting divergence, not for security."""
        rank, total = self.group.rank, 0
        held = [t for t, e in zip(tensors, self.entries) if e.sharded or rank == 0]
        for t, (offset, n) in zip(held, self._pieces(replicated_to_all=False)[rank]):
            if n:
                bits = t.detach().reshape(-1).to(torch.float32).view(torch.int32).to(torch.int64)
                mix = torch.arange(offset, offset + n, dtype=torch.int64, device=bits.device).mul_(_MIX).add_(1)
                total += int(bits.mul_(mix).sum())
        return total % (1 << 64)

    def island_checksum(self, tensors: Sequence[Tensor]) -> int:
        """:meth:`checksum` summed over the island's ranks (modulo 2^64; a collective of the island)."""
        return sum(self.group.all_gather_object(self.checksum(tensors))) % (1 << 64)

    def shard_of(self, flat: Tensor, index: int) -> Tensor:
        """This rank's part of parameter ``index`` cut out of the full flat vector (a view)."""
        e = self.entries[index]
        full = flat[e.offset : e.offset + e.numel].view(e.shape)
        if not e.sharded or not e.shape:
            return full
        start, stop = self._rows(e, self.group.rank)
        return full[start:stop]
