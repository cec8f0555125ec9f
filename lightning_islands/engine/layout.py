"""The canonical layout: every parameter's full tensor, flattened, concatenated in module order.

Islands shard the same parameters differently: FSDP2 over 2 ranks here, tensor parallel plus FSDP2
on a 2-D mesh there, whole on 1 rank elsewhere. They meet in this layout: each round gathers the
island's local shards to its leader and scatters from it (:meth:`CanonicalLayout.gather_to_leader`,
:meth:`CanonicalLayout.scatter_from_leader`), a range of the flat vector at a time, so that only the
leader holds values beyond its own shards, and only those of the range.

What a rank holds of a parameter is the full tensor indexed, along each dimension, by a list of
indices (:class:`Placing`): a DTensor's placements say which, on any mesh (``Shard`` on any
dimension, FSDP2's strided shards over tensor-parallel ones, ``Replicate``), and a plain tensor is
whole on every rank. Each rank works its own lists out from its own placements; the island shares
them once. Copies held by several ranks (replicated, or plain) are gathered from the lowest of those
ranks only, and scattered to all of them. The ranks talk through an
:class:`~lightning_islands.engine.group.IslandGroup`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_islands.engine.group import IslandGroup, SoloGroup

_SHARD_FIX = ("An island's shards must be what each parameter's DTensor placements give (torch.chunk splits along "
              "each sharded dimension, as FSDP2 and tensor parallelism cut them); shard the module with fully_shard "
              "or parallelize_module, and do not resize or replace the local shards")

_MIX = 2_654_435_761  # Knuth's multiplicative hash constant: the checksum's weights are MIX * index + 1
# SplitMix64's multipliers as signed int64 (the sketch's hash)
_SPLITMIX = tuple(c - (1 << 64) if c >= 1 << 63 else c for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                                                 0x94D049BB133111EB))
SKETCH_WIDTH = 256  # buckets of a layout's count sketch (a power of two)
_LOOP_MAX = 16  # runs copied one slice at a time up to this many; more go through one index per parameter

Index = range | Tensor  # the indices held along one dimension: a range where they are contiguous
Held = tuple[Index, ...] | None  # the index lists a rank holds along each dimension; None: the whole tensor
_ROWS_CACHE = 4096  # (rank, range) entries of a layout's row cache: a round's chunks, for every rank


@dataclass(frozen=True, eq=False)
class Placing:
    """How a DTensor lies over an island's ranks: ``mesh``, the island ranks of its device mesh (an
    integer tensor shaped like the mesh), and ``placements``, one per mesh dimension."""

    mesh: Tensor
    placements: tuple[Any, ...]

    @classmethod
    def of(cls, param: Tensor) -> Placing:
        """The placing of a DTensor (its mesh's ranks must be the island's, as in its own world)."""
        return cls(param.device_mesh.mesh.detach().cpu(), tuple(param.placements))  # type: ignore[attr-defined]

    def held(self, shape: Sequence[int], rank: int) -> tuple[Index, ...]:
        """The indices ``rank`` holds along each dimension of a tensor of ``shape`` (a ``range``
        where contiguous): each mesh dimension, in order, splits the list of the dimension its
        placement shards, as DTensor splits the tensor (torch's own split, strided shards included)."""
        where = (self.mesh == rank).nonzero()
        if len(where) != 1:
            raise ValueError(f"rank {rank} is not on the device mesh {self.mesh.tolist()}")
        coord = where[0].tolist()
        lists = [torch.arange(int(n), dtype=torch.int64) for n in shape]
        for m, p in enumerate(self.placements):
            if p.is_replicate():
                continue
            if not _splits(p):
                raise NotImplementedError(f"a parameter placed as {p} (islands take Shard and Replicate placements)")
            d = p.dim
            column = lists[d].view([1] * d + [-1] + [1] * (len(shape) - d - 1))
            chunks = p._split_tensor(column, int(self.mesh.shape[m]), with_padding=False)[0]
            lists[d] = chunks[coord[m]].reshape(-1) if coord[m] < len(chunks) else lists[d][:0]
        return tuple(_compact(x) for x in lists)


def _compact(indices: Tensor) -> Index:
    """``indices`` as a ``range`` when they are contiguous and increasing, else as they are."""
    n = len(indices)
    if n == 0:
        return range(0)
    first = int(indices[0])
    if int(indices[-1]) == first + n - 1 and (n < 3 or torch.equal(indices, torch.arange(first, first + n))):
        return range(first, first + n)
    return indices


def _tensor(indices: Index) -> Tensor:
    return torch.arange(indices.start, indices.stop) if isinstance(indices, range) else indices


def _key(held: Held) -> Any:
    """A hashable key of what a rank holds: ranks with equal keys hold copies of the same values."""
    return None if held is None else tuple(x if isinstance(x, range) else x.numpy().tobytes() for x in held)


def _splits(placement: Any) -> bool:
    """Whether a placement splits a dimension: ``Shard``, or FSDP2's strided shard over tensor parallel."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.is_shard() or isinstance(placement, _StridedShard)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _runs(shape: tuple[int, ...], held: Held) -> tuple[Tensor, Tensor]:
    """The flat offsets (in the parameter) and lengths of the contiguous runs of the part ``held``
    of a tensor of ``shape``, in the part's own row-major order."""
    numel = _numel(shape)
    one = torch.zeros(1, dtype=torch.int64)
    if held is None or not shape:
        return one, one + numel
    if any(len(h) == 0 for h in held):
        return one[:0], one[:0]
    strides = [_numel(shape[d + 1:]) for d in range(len(shape))]
    d = len(shape)
    while d and held[d - 1] == range(shape[d - 1]):  # whole trailing dims: one block
        d -= 1
    if d == 0:
        return one, one + numel
    inner = strides[d - 1]
    last = _tensor(held[d - 1])
    first = torch.cat([one, (last[1:] != last[:-1] + 1).nonzero().reshape(-1) + 1])  # where stretches start
    seg_len = torch.diff(torch.cat([first, torch.tensor([len(last)])])) * inner
    outer = one
    for j in range(d - 1):
        outer = (outer[:, None] + _tensor(held[j])[None, :] * strides[j]).reshape(-1)
    return (outer[:, None] + (last[first] * inner)[None, :]).reshape(-1), seg_len.repeat(len(outer))


def _mix64(index: Tensor) -> Tensor:
    """SplitMix64's finalizer of int64 ``index`` (wrapping arithmetic; shifts made logical by masks):
    well-mixed bits for the sketch's buckets and signs, however regular the indices."""
    h = index.mul(_SPLITMIX[0])
    for (shift, mask), mult in zip(((30, (1 << 34) - 1), (27, (1 << 37) - 1), (31, (1 << 33) - 1)),
                                   (*_SPLITMIX[1:], None)):
        h = h.bitwise_xor(h.bitwise_right_shift(shift).bitwise_and_(mask))
        if mult is not None:
            h = h.mul_(mult)
    return h


def _expand(pos: Tensor, n: Tensor, device: torch.device | None = None) -> Tensor:
    """The positions of runs starting at ``pos`` with lengths ``n``, one after another (on ``device``)."""
    if len(n) == 1:
        return torch.arange(int(pos[0]), int(pos[0]) + int(n[0]), device=device)
    pos, n = pos.to(device), n.to(device)
    total = int(n.sum())
    before = torch.cumsum(n, 0) - n
    return torch.repeat_interleave(pos - before, n, output_size=total) + torch.arange(total, device=device)


def _move(src: Tensor, spos: Tensor, dst: Tensor, dpos: Tensor, n: Tensor) -> None:
    """``dst``'s (1-D) runs ``(dpos, n)`` get ``src``'s (1-D) runs ``(spos, n)``."""
    if len(n) <= _LOOP_MAX:
        for a, b, k in zip(spos.tolist(), dpos.tolist(), n.tolist()):
            dst[b : b + k].copy_(src[a : a + k])
    else:
        dst.index_copy_(0, _expand(dpos, n, dst.device),
                        src.index_select(0, _expand(spos, n, src.device)).to(dst.device, dst.dtype))


def _read(src: Tensor, pos: Tensor, n: Tensor, out: Tensor) -> None:
    """``out`` (1-D) gets ``src``'s (1-D) runs ``(pos, n)``, one after another."""
    _move(src, pos, out, torch.cumsum(n, 0) - n, n)


def _write(dst: Tensor, pos: Tensor, n: Tensor, values: Tensor) -> None:
    """``dst``'s (1-D) runs ``(pos, n)`` get ``values`` (1-D), one after another."""
    _move(values, torch.cumsum(n, 0) - n, dst, pos, n)


@dataclass(frozen=True)
class Entry:
    """One parameter's place in the flat vector."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass
class _Part:
    """What one rank holds of one parameter: its index lists, shape, whether it gathers them, and
    (worked out when first needed) their runs."""

    held: Held
    shape: tuple[int, ...]
    owner: bool  # the lowest rank holding these values: it alone gathers them
    full: tuple[int, ...]  # the parameter's shape
    _runs: tuple[Tensor, Tensor, Tensor] | None = None

    @property
    def runs(self) -> tuple[Tensor, Tensor, Tensor]:
        """Flat offsets in the parameter of the runs (in local order), their lengths, and where
        each starts in the rank's local (flattened) tensor."""
        if self._runs is None:
            starts, lengths = _runs(self.full, self.held)
            self._runs = (starts, lengths, torch.cumsum(lengths, 0) - lengths)
        return self._runs


Rows = list[tuple[int, Tensor, Tensor, Tensor]]  # per parameter: (index, local positions, range positions, lengths)


class CanonicalLayout:
    """Offsets of named parameters in the flat vector, and the gather/scatter between it and shards.

    Args:
        params: ``(name, full shape, placing)`` per parameter, in module order; the placing is
            ``False`` (whole on every rank), ``True`` (FSDP2's ``Shard(0)`` over the island's ranks)
            or a :class:`Placing`.
        group: the island's ranks (default: an island of one process).
        held: what every rank holds (``held[rank][i]`` as :meth:`Placing.held` gives it, ``None``
            for whole), in place of working it out from ``params``' placings (which then are not read).
    """

    def __init__(self, params: Sequence[tuple[str, Sequence[int], bool | Placing]], group: IslandGroup | None = None,
                 held: Sequence[Sequence[Held]] | None = None) -> None:
        entries, offset = [], 0
        for name, shape, _ in params:
            shape = tuple(int(d) for d in shape)
            entries.append(Entry(name, shape, offset, _numel(shape)))
            offset += entries[-1].numel
        self.entries: list[Entry] = entries
        self._offsets = [e.offset for e in entries]
        self.numel = offset
        self.group: IslandGroup = group if group is not None else SoloGroup()
        world = self.group.size
        if held is None:
            fsdp = Placing(torch.arange(world), (_shard0(),))
            held = [[None if placing is False else (fsdp if placing is True else placing).held(e.shape, r)
                     for e, (_, _, placing) in zip(entries, params)] for r in range(world)]
        if len(held) != world or any(len(h) != len(entries) for h in held):
            raise ValueError(f"held must give each of the {world} ranks a part of each of the {len(entries)} "
                             "parameters")
        self._parts: list[list[_Part]] = [[] for _ in range(world)]
        self._rows_cache: dict[tuple[int, int, int, bool], Rows] = {}
        for i, e in enumerate(entries):
            seen: set = set()
            for r in range(world):
                h = held[r][i]
                h = None if h is None else tuple(x if isinstance(x, range) else _compact(x) for x in h)
                key = _key(h)
                self._parts[r].append(_Part(h, e.shape if h is None else tuple(len(x) for x in h), key not in seen,
                                            e.shape))
                seen.add(key)
            self._check_partition(i)

    @classmethod
    def from_parameters(cls, named: Sequence[tuple[str, Tensor]], group: IslandGroup | None = None
                        ) -> CanonicalLayout:
        """The layout of a module's parameters: plain tensors, or DTensors placed in any way
        :class:`Placing` takes. A collective of the island: the ranks share what each holds, and
        every rank checks that its shards have the shapes that gives; all raise if any rank's differ."""
        from torch.distributed.tensor import DTensor

        group = group if group is not None else SoloGroup()
        own = [Placing.of(p).held(tuple(p.shape), group.rank) if isinstance(p, DTensor) else None for _, p in named]
        held = group.all_gather_object(own) if group.size > 1 else [own]
        layout = cls([(n, tuple(p.shape), False) for n, p in named], group, held=held)
        layout.check_local_shapes([tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)
                                   for _, p in named])
        return layout

    def subset(self, indices: Sequence[int]) -> CanonicalLayout:
        """The layout of the parameters ``indices`` alone (a fragment), over the same ranks."""
        return CanonicalLayout([(self.entries[i].name, self.entries[i].shape, False) for i in indices], self.group,
                               held=[[parts[i].held for i in indices] for parts in self._parts])

    def _check_partition(self, index: int) -> None:
        """Raise unless the ranks that gather parameter ``index`` hold each of its values exactly once."""
        e = self.entries[index]
        owners = [parts[index] for parts in self._parts if parts[index].owner]
        if len(owners) == 1 and owners[0].shape == e.shape:  # one rank holds it all (a plain tensor, or one rank)
            return
        if all(p.held is not None and all(isinstance(x, range) for x in p.held) for p in owners) and \
                sum(_numel(p.shape) for p in owners) == e.numel and _disjoint_blocks([p.held for p in owners]):
            return  # blocks of the tensor (any Shard split), disjoint and as many values as it has
        starts = torch.cat([p.runs[0] for p in owners])
        lengths = torch.cat([p.runs[1] for p in owners])
        order = torch.argsort(starts)
        starts, lengths = starts[order], lengths[order]
        ends = starts + lengths
        covered = (starts[0] == 0 and ends[-1] == e.numel and torch.equal(starts[1:], ends[:-1])) if len(starts) \
            else e.numel == 0
        if not covered:
            raise ValueError(f"the island's ranks do not hold every value of {e.name} {e.shape} exactly once (their "
                             f"parts overlap without being copies, or leave values out). {_SHARD_FIX}")

    @property
    def has_copies(self) -> bool:
        """Whether some rank holds values another one gathers (plain or replicated parameters on an
        island of several ranks): those copies only agree if something keeps them so."""
        return any(not part.owner for parts in self._parts for part in parts)

    def copied(self) -> list[int]:
        """The parameters some rank holds a copy of (values another rank gathers), in order."""
        return [i for i in range(len(self.entries)) if any(not parts[i].owner for parts in self._parts)]

    def check_local_shapes(self, held: Sequence[Sequence[int]]) -> None:
        """Raise on every rank of the island unless every rank holds, of each parameter, the shape
        the layout cuts for it (``held``: this rank's shapes, in parameter order); a collective."""
        self._agree(next((f"holds {tuple(shape)} of {e.name}, the layout gives it {self.local_shape(i)}"
                          for i, (e, shape) in enumerate(zip(self.entries, held))
                          if tuple(shape) != self.local_shape(i)), None))

    def describe(self) -> list[list]:
        """``[name, shape]`` pairs, the model part of a rendezvous fingerprint (how the island
        shards the parameters is not part of it: islands that shard differently still meet)."""
        return [[e.name, list(e.shape)] for e in self.entries]

    def owns(self, index: int, rank: int | None = None) -> bool:
        """Whether ``rank`` (default: this rank) is the one that gathers its part of parameter
        ``index``: the lowest rank holding those values (for a plain tensor, rank 0)."""
        return self._parts[self.group.rank if rank is None else rank][index].owner

    def local_shape(self, index: int, rank: int | None = None) -> tuple[int, ...]:
        """The shape of ``rank``'s (default: this rank's) part of parameter ``index``."""
        return self._parts[self.group.rank if rank is None else rank][index].shape

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

    def _rows(self, rank: int, start: int, stop: int, gathering: bool) -> Rows:
        """What ``rank`` holds inside ``[start, stop)``, per parameter in order: its runs' positions
        in the local tensor and in the range, and their lengths. ``gathering``: only what it owns."""
        cached = self._rows_cache.get((rank, start, stop, gathering))
        if cached is not None:
            return cached
        first = max(bisect.bisect_right(self._offsets, start) - 1, 0)
        rows: Rows = []
        for i in range(first, len(self.entries)):
            e, part = self.entries[i], self._parts[rank][i]
            if e.offset >= stop:
                break
            if (gathering and not part.owner) or e.offset + e.numel <= start or not _numel(part.shape):
                continue
            starts, lengths, locs = part.runs
            g = starts + e.offset
            a, b = g.clamp(min=start), (g + lengths).clamp(max=stop)
            keep = a < b
            if keep.any():
                rows.append((i, (locs + a - g)[keep], (a - start)[keep], (b - a)[keep]))
        if len(self._rows_cache) >= _ROWS_CACHE:
            self._rows_cache.clear()
        self._rows_cache[rank, start, stop, gathering] = rows
        return rows

    @staticmethod
    def _size(rows: Rows) -> int:
        return sum(int(n.sum()) for *_, n in rows)

    @staticmethod
    def _pack(rows: Rows, tensors: Sequence[Tensor], out: Tensor) -> None:
        """``out`` gets the values of ``rows`` from this rank's local ``tensors``, one after another."""
        at = 0
        for i, loc, _, n in rows:
            k = int(n.sum())
            _read(tensors[i].reshape(-1), loc, n, out[at : at + k])
            at += k

    def gather_to_leader(self, locals_: Sequence[Tensor], device: torch.device,
                         out_device: torch.device | None = None, start: int = 0,
                         stop: int | None = None, into: Tensor | None = None) -> Tensor | None:
        """The fp32 values ``[start, stop)`` (default: all) of the flat vector on the island's rank 0
        (on ``out_device``, default ``device``), ``None`` on the other ranks, which send only the
        values they own in the range (``locals_[i]``: this rank's part of parameter ``i``): one flat
        buffer each, on ``device`` (the GPU for NCCL), received by the leader one rank at a time into
        a reused buffer, so the leader holds the range and one rank's part of it at most. ``into``
        (leader, optional): a flat fp32 tensor of ``stop - start`` values on ``out_device`` to gather
        into and return, instead of a new one. A collective inside the island: every rank must call
        it, with the same range."""
        start, stop = self._range(start, stop)
        world, rank = self.group.size, self.group.rank
        out_device, device = out_device or device, self.group.transfer_device(device) if world > 1 else device
        if world > 1:
            self._agree(next((f"holds {t.numel()} values of {e.name}, the layout expects {_numel(self.local_shape(i))}"
                              for i, (t, e) in enumerate(zip(locals_, self.entries))
                              if self.owns(i) and t.numel() != _numel(self.local_shape(i))), None))
        if rank != 0:  # a rank works out its own part only; the leader, everyone's
            rows = self._rows(rank, start, stop, gathering=True)
            mine = torch.empty(self._size(rows), dtype=torch.float32, device=device)
            self._pack(rows, locals_, mine)
            if len(mine):  # the leader knows every size: nothing is sent for empty parts
                self.group.send(mine, 0)
            return None
        parts = [self._rows(r, start, stop, gathering=True) for r in range(world)]
        sizes = [self._size(rows) for rows in parts]
        if into is not None and (into.numel() != stop - start or into.dtype != torch.float32):
            raise ValueError(f"into holds {into.numel()} {into.dtype} values for the range [{start}, {stop})")
        full = torch.empty(stop - start, dtype=torch.float32, device=out_device) if into is None else into
        for i, loc, pos, n in parts[0]:  # the leader's own part, straight into place
            _move(locals_[i].reshape(-1), loc, full, pos, n)
        buf = torch.empty(max(sizes[1:], default=0), dtype=torch.float32, device=device)
        for r in range(1, world):
            if not sizes[r]:
                continue
            src = buf[: sizes[r]]
            self.group.recv(src, r)
            at = 0
            for _, _, pos, n in parts[r]:
                k = int(n.sum())
                _write(full, pos, n, src[at : at + k])
                at += k
        return full

    def scatter_from_leader(self, flat: Tensor | None, device: torch.device, start: int = 0,
                            stop: int | None = None, into: Sequence[Tensor] | None = None) -> list[Tensor]:
        """This rank's part of each parameter (shaped like its local shard, fp32, on ``device``; on
        the host over gloo) cut from the values ``[start, stop)`` (default: all) of the flat vector,
        ``flat``, that only the island's rank 0 holds (``None`` elsewhere). The leader sends each
        rank only its own part (every copy of a replicated one), one rank at a time from a reused
        buffer.

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
        device = self.group.transfer_device(device) if world > 1 else device
        if into is not None and world > 1:
            self._agree(next((f"holds {tuple(t.shape)} of {e.name}, the layout gives it {self.local_shape(i)}"
                              for i, (e, t) in enumerate(zip(self.entries, into))
                              if t.numel() != _numel(self.local_shape(i))), None))
        parts = [self._rows(r, start, stop, gathering=False) if r == rank or rank == 0 else [] for r in range(world)]
        sizes = [self._size(rows) for rows in parts]
        mine = torch.empty(sizes[rank], dtype=torch.float32, device=device)
        if rank == 0:
            assert flat is not None
            if flat.numel() != stop - start:
                raise ValueError(f"flat holds {flat.numel()} values for the range [{start}, {stop})")
            buf = torch.empty(max(sizes), dtype=torch.float32, device=device)
            for r in [*range(1, world), 0]:  # the leader's own part last, straight into ``mine``
                dst = mine if r == 0 else buf[: sizes[r]]
                at = 0
                for _, _, pos, n in parts[r]:
                    k = int(n.sum())
                    _read(flat, pos, n, dst[at : at + k])
                    at += k
                if r and sizes[r]:
                    self.group.send(dst, r)
        elif sizes[rank]:
            self.group.recv(mine, 0)
        if into is None:  # the whole range: each parameter's part, in local order, is one view of ``mine``
            out, at = [], 0
            for i in range(len(self.entries)):
                k = _numel(self.local_shape(i))
                out.append(mine[at : at + k].view(self.local_shape(i)))
                at += k
            return out
        at = 0
        for i, loc, _, n in parts[rank]:
            k = int(n.sum())
            _write(into[i].view(-1), loc, n, mine[at : at + k])
            at += k
        return list(into)

    def to_owners(self, locals_: Sequence[Tensor], bounds: Sequence[tuple[int, int]], device: torch.device,
                  out_device: torch.device | None = None) -> Tensor | None:
        """An all-to-all of the island: rank ``r`` (for each ``r < len(bounds)``) receives the fp32
        values ``bounds[r]`` of the flat vector from whichever ranks own them (``locals_[i]``: this
        rank's part of parameter ``i``); returns this rank's range (on ``out_device``, default
        ``device``), ``None`` for a rank that owns none. Every rank sends each owner its part at once,
        so the ranges move in parallel and an owner holds its range and what it receives for it. A
        collective inside the island: every rank must call it, with the same ``bounds``."""
        world, rank = self.group.size, self.group.rank
        out_device = out_device or device
        wire = self.group.transfer_device(device) if world > 1 else device
        if world > 1:
            self._agree(next((f"holds {t.numel()} values of {e.name}, the layout expects {_numel(self.local_shape(i))}"
                              for i, (t, e) in enumerate(zip(locals_, self.entries))
                              if self.owns(i) and t.numel() != _numel(self.local_shape(i))), None))
        own, sends, recvs = None, [], []
        for r, (start, stop) in enumerate(bounds):
            start, stop = self._range(start, stop)
            if start == stop:
                continue
            if r != rank:
                rows = self._rows(rank, start, stop, gathering=True)
                if self._size(rows):
                    buf = torch.empty(self._size(rows), dtype=torch.float32, device=wire)
                    self._pack(rows, locals_, buf)
                    sends.append((r, buf))
                continue
            own = torch.empty(stop - start, dtype=torch.float32, device=out_device)
            for i, loc, pos, n in self._rows(rank, start, stop, gathering=True):
                _move(locals_[i].reshape(-1), loc, own, pos, n)
            for src in range(world):
                rows = self._rows(src, start, stop, gathering=True) if src != rank else []
                if rows and self._size(rows):
                    recvs.append((src, torch.empty(self._size(rows), dtype=torch.float32, device=wire), rows))
        self.group.exchange(sends, [(src, buf) for src, buf, _ in recvs])
        del sends
        for _, buf, rows in recvs:
            at = 0
            for _, _, pos, n in rows:
                k = int(n.sum())
                _write(own, pos, n, buf[at : at + k])  # type: ignore[arg-type]
                at += k
        return own

    def from_owners(self, flat: Tensor | None, bounds: Sequence[tuple[int, int]], device: torch.device,
                    into: Sequence[Tensor]) -> list[Tensor]:
        """The reverse of :meth:`to_owners`: the owner of each range of ``bounds`` (``flat`` holds its
        own range's values, ``None`` on a rank that owns none) sends every rank its part of it (each
        copy of a replicated one), at once; ``into``: tensors shaped like this rank's shards (any
        device and float dtype) that take the values, returned. A collective inside the island."""
        world, rank = self.group.size, self.group.rank
        wire = self.group.transfer_device(device) if world > 1 else device
        sends, recvs = [], []
        for r, (start, stop) in enumerate(bounds):
            start, stop = self._range(start, stop)
            if start == stop:
                continue
            if r == rank:
                assert flat is not None and flat.numel() == stop - start, "the owner's range is its slice"
                for dst in range(world):
                    rows = self._rows(dst, start, stop, gathering=False)
                    if not self._size(rows):
                        continue
                    where = wire if dst != rank else flat.device
                    buf = torch.empty(self._size(rows), dtype=torch.float32, device=where)
                    at = 0
                    for _, _, pos, n in rows:
                        k = int(n.sum())
                        _read(flat, pos, n, buf[at : at + k])
                        at += k
                    if dst == rank:
                        recvs.append((None, buf, rows))
                    else:
                        sends.append((dst, buf))
            else:
                rows = self._rows(rank, start, stop, gathering=False)
                if self._size(rows):
                    recvs.append((r, torch.empty(self._size(rows), dtype=torch.float32, device=wire), rows))
        self.group.exchange(sends, [(src, buf) for src, buf, _ in recvs if src is not None])
        del sends
        for _, buf, rows in recvs:
            at = 0
            for i, loc, _, n in rows:
                k = int(n.sum())
                _write(into[i].view(-1), loc, n, buf[at : at + k])
                at += k
        return list(into)

    def checksum(self, tensors: Sequence[Tensor]) -> int:
        """A checksum of fp32 tensors shaped like this rank's shards (the anchors, the momentum) that
        depends only on the canonical vector's bits, not on how the island shards it: each value's
        bits times an odd number made from its canonical index, summed modulo 2^64 (int64 arithmetic
        wraps) over the values this rank owns, so the island's sum over its ranks
        (:meth:`island_checksum`) is the same on every island that holds the same global state. For
        spotting divergence, not for security."""
        total = 0
        for i, (t, e) in enumerate(zip(tensors, self.entries)):
            part = self._parts[self.group.rank][i]
            if not part.owner or not _numel(part.shape):
                continue
            bits = t.detach().reshape(-1).to(torch.float32).view(torch.int32).to(torch.int64)
            starts, lengths, _ = part.runs
            index = _expand(starts + e.offset, lengths, bits.device)
            total += int(bits.mul_(index.mul_(_MIX).add_(1)).sum())
        return total % (1 << 64)

    def sketch(self, tensors: Sequence[Tensor]) -> Tensor:
        """A count sketch (:data:`SKETCH_WIDTH` float64 buckets) of the values of fp32 tensors shaped
        like this rank's shards that this rank owns: canonical value ``c`` adds ``±x_c`` to a bucket,
        bucket and sign from a SplitMix64 hash of its canonical index, so the island's sum
        over its ranks (:meth:`island_sketch`) depends only on the canonical vector. The sketch is
        linear, and ``||sketch(a) - sketch(b)||^2`` estimates ``||a - b||^2`` without bias (relative
        spread about ``sqrt(2 / width)``, 9%): how far apart two islands' global models are, from a
        few numbers in their round headers."""
        out = torch.zeros(SKETCH_WIDTH, dtype=torch.float64)
        for i, (t, e) in enumerate(zip(tensors, self.entries)):
            part = self._parts[self.group.rank][i]
            if not part.owner or not _numel(part.shape):
                continue
            values = t.detach().reshape(-1).to(torch.float64)  # where the shard lives (a GPU's, on a GPU)
            starts, lengths, _ = part.runs
            h = _mix64(_expand(starts + e.offset, lengths, values.device))
            sign = h.bitwise_right_shift(40).bitwise_and_(1).mul_(2).sub_(1)
            part_sketch = torch.zeros(SKETCH_WIDTH, dtype=torch.float64, device=values.device)
            out += part_sketch.index_add_(0, h.bitwise_and_(SKETCH_WIDTH - 1), values.mul_(sign)).cpu()
        return out

    def island_sketch(self, tensors: Sequence[Tensor]) -> list[float]:
        """:meth:`sketch` summed over the island's ranks (a collective of the island)."""
        return self.group.sum(self.sketch(tensors).tolist())

    def island_checksum(self, tensors: Sequence[Tensor]) -> int:
        """:meth:`checksum` summed over the island's ranks (modulo 2^64; a collective of the island)."""
        return sum(self.group.all_gather_object(self.checksum(tensors))) % (1 << 64)

    def shard_of(self, flat: Tensor, index: int) -> Tensor:
        """This rank's part of parameter ``index`` cut out of the full flat vector (a view where the
        part is a block of the tensor, else a copy)."""
        e = self.entries[index]
        part = flat[e.offset : e.offset + e.numel].view(e.shape)
        held = self._parts[self.group.rank][index].held
        for d, idx in enumerate(held or ()):
            if isinstance(idx, range):
                part = part.narrow(d, idx.start, len(idx))
            else:
                part = part.index_select(d, idx.to(part.device))
        return part


def _disjoint_blocks(blocks: Sequence[tuple[range, ...]]) -> bool:
    """Whether no two non-empty blocks (a range per dimension) share a value, judged along one
    dimension where their ranges do not overlap (False: not shown this way)."""
    blocks = [b for b in blocks if all(len(x) for x in b)]
    for d in range(len(blocks[0]) if blocks else 0):
        spans = sorted((b[d].start, b[d].stop) for b in blocks)
        if all(stop <= nxt for (_, stop), (nxt, _) in zip(spans, spans[1:])):
            return True
    return not blocks


def _shard0() -> Any:
    from torch.distributed.tensor import Shard

    return Shard(0)
