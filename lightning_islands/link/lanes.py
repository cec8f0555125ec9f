"""The lanes: the gloo groups one member set's payloads move on, several TCP streams per pair.

A member set's lanes are built under one key in the coordinator's store (:meth:`Lanes.build`); each
lane is one gloo group of the islands present, and between two islands each lane has two groups
more, one per direction (one gloo connection carrying both directions at once moved only about half
the link's rate each way on a shaped link; two of them 0.95 each way: docs/BENCHMARKS.md, lanes).
A payload is cut into one piece per lane and the pieces move in parallel. A member set's groups are
destroyed when the next set's are built (no operation is in them then), except groups an abandoned
operation is still inside: those wait until its thread ends (gloo's ``abort()`` and ``shutdown()``
do not cancel an operation, and destroying a group one is inside is what may abort the process), so
descriptors and threads stay bounded however often the member set changes. Nothing here knows which
rank holds the lanes or what the bytes mean: it moves 1-D uint8 CPU tensors, and a failed group
raises gloo's ``RuntimeError`` for the caller to turn into a lost round.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_islands.link.coordinator import ENV_LINK_IFNAME

SIZE_TAG, DATA_TAG = 1, 2  # the gloo tags of a swap's sizes and of its pieces
START_LANES = "lanes"  # the key of the lanes every island opens when the run starts (IslandLink.open_lanes)


def group_prefixes(prefix: str, count: int, size: int) -> list[str]:
    """The store prefix of each group of ``count`` lanes among ``size`` members under ``prefix``:
    one per lane, and between two members one more per lane and direction."""
    names = [f"lane{k}" for k in range(count)]
    if size == 2:
        names += [f"lane{k}/from{i}" for k in range(count) for i in range(2)]
    return [f"{prefix}{n}/" for n in names]


def rendezvous_keys(prefix: str, count: int, size: int) -> list[str]:
    """The keys the rendezvous of :meth:`Lanes.build` under ``prefix`` leaves in the store: gloo's
    full mesh has each member publish its address under ``<group prefix>/<device>/<rank>`` (one
    device per group here; as measured with torch 2.13). Nobody reads them once every member's
    groups are built, so they can go once a round after the build has counted. None for fewer
    than two members (no lanes)."""
    if size < 2:
        return []
    return [f"{group}/0/{rank}" for group in group_prefixes(prefix, count, size) for rank in range(size)]


class Lanes:
    """``count`` lanes between the islands of one member set at a time (rebuilt for each set).

    Args:
        connect: opens a new client connection to the coordinator (each group's rendezvous gets its
            own, kept for the next rebuild).
        count: lanes per member set.
        timeout: gloo's timeout of every operation on the groups.
        interface: the network interface the groups bind to (``None``: gloo's default device).
        name: how threads and errors name this end (e.g. ``island 1``).
    """

    def __init__(self, connect: Callable[[], dist.Store], count: int, timeout: timedelta,
                 interface: str | None, name: str) -> None:
        if count < 1:
            raise ValueError(f"lanes must be >= 1, got {count}")
        self.connect, self.count, self.timeout, self.interface, self.name = connect, count, timeout, interface, name
        self.groups: list = []
        self.directed: list = []  # two islands: directed[k][i] carries what island i's end sends on lane k
        self.rank, self.size = 0, 1
        # groups an abandoned operation may still be inside, each with the event its thread sets when it
        # ends: destroyed at the first build after that
        self._retired: list[tuple[list, threading.Event]] = []
        self._generation = 0  # advanced by every build and retire: an abandoned build keeps nothing
        self._stores: list[dist.Store | None] = []  # one store connection per group, reused

    def build(self, prefix: str, rank: int, size: int) -> None:
        """The lanes of a member set of ``size`` islands, this one ``rank`` among them, under the
        store ``prefix`` (every member builds them with the same prefix); none for fewer than two."""
        self._release()
        self._generation += 1
        generation = self._generation
        self.rank, self.size = rank, size
        if size < 2:
            return
        groups = self._rendezvous([(group, rank, size) for group in group_prefixes(prefix, self.count, size)])
        if generation != self._generation:  # retired while it was built (abandoned): nothing runs on them
            return
        self.groups = groups[: self.count]
        self.directed = [groups[self.count + 2 * k : self.count + 2 * k + 2] for k in range(self.count)] \
            if size == 2 else []

    def _rendezvous(self, specs: Sequence[tuple[str, int, int]]) -> list:
        """Build one gloo group per ``(store prefix, rank, size)``, all at once.

        Each group's rendezvous waits for its peers through the store, a few round trips to the
        coordinator: one after another they cost 3.1 s at 100 ms for two lanes between two islands,
        11.4 s for eight; at once, 0.9 s for either (docs/BENCHMARKS.md, lanes). Each runs in its
        own thread on its own store connection (a store connection serves one request at a time, so
        a rendezvous waiting for a peer would hold up the others on a shared one).
        """
        options = [self._options() for _ in specs]  # a bad interface fails here, before any thread
        stores = self._stores  # this build's list (retire() replaces it: an abandoned build keeps its own)
        stores += [None] * (len(specs) - len(stores))  # connected on first use
        built: list = [None] * len(specs)

        def build(k: int) -> None:
            try:
                if stores[k] is None:
                    stores[k] = self.connect()
                prefix, rank, size = specs[k]
                built[k] = dist.ProcessGroupGloo(dist.PrefixStore(prefix, stores[k]), rank, size, options[k])
            except Exception as err:  # noqa: BLE001 - raised below, in the caller's thread
                built[k] = err

        threads = [threading.Thread(target=build, args=(k,), name=f"{self.name}-lane{k}", daemon=True)
                   for k in range(len(specs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [g for g in built if isinstance(g, Exception)]
        if failed:
            raise RuntimeError(str(failed[0])) from failed[0]
        return built

    def _options(self) -> dist.ProcessGroupGloo._Options | timedelta:
        """A group's gloo options: bound to :attr:`interface` when one is set, else just the timeout
        (gloo's default device)."""
        if not self.interface:
            return self.timeout
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = self.timeout
        try:
            opts._devices = [dist.ProcessGroupGloo.create_device(interface=self.interface)]
        except RuntimeError as err:
            raise RuntimeError(f"{self.name} cannot bind its lanes to interface {self.interface!r} "
                               f"({err}); fix or unset {ENV_LINK_IFNAME}") from err
        return opts

    def sizes(self, n: int) -> list[int]:
        """Every member's payload size (``n``: this one's), in member order."""
        mine = torch.tensor([n], dtype=torch.int64)
        out = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
        self.groups[0].allgather([out], [mine]).wait()
        return [int(t.item()) for t in out]

    def all_gather(self, payload: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Every member's payload (of ``sizes``), in member order; this one's is ``payload``."""
        return self._pairwise(payload, sizes) if self.directed else self._ring(payload, sizes)

    def _pieces(self, size: int) -> list[tuple[int, int]]:
        """``[start, stop)`` of each lane's piece of a payload of ``size`` bytes."""
        per = -(-size // len(self.groups)) if size else 0
        return [(min(k * per, size), min((k + 1) * per, size)) for k in range(len(self.groups))]

    def _pairwise(self, payload: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Two members: each lane's piece of this payload goes out on this member's direction and the
        peer's piece arrives on the other, straight into place (no padding, no copies)."""
        me, peer = self.rank, 1 - self.rank
        received = torch.empty(sizes[peer], dtype=torch.uint8)
        works = []
        for k, ((a, b), (c, d)) in enumerate(zip(self._pieces(sizes[me]), self._pieces(sizes[peer]))):
            if b > a:
                works.append(self.directed[k][me].send([payload[a:b]], peer, 0))
            if d > c:
                works.append(self.directed[k][peer].recv([received[c:d]], peer, 0))
        for w in works:
            w.wait()
        return [payload, received] if me == 0 else [received, payload]

    def _ring(self, payload: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Three or more members: gloo's ring all-gather on every lane, over pieces padded to one size."""
        n_lanes = len(self.groups)
        chunk = (max(sizes) + n_lanes - 1) // n_lanes if max(sizes) else 0
        if not chunk:
            return [torch.empty(0, dtype=torch.uint8) for _ in sizes]
        padded = torch.zeros(chunk * n_lanes, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        outs = [[torch.empty(chunk, dtype=torch.uint8) for _ in sizes] for _ in range(n_lanes)]
        works = [lane.allgather([outs[k]], [padded[k * chunk : (k + 1) * chunk]]) for k, lane in enumerate(self.groups)]
        for w in works:
            w.wait()
        return [torch.cat([outs[k][i] for k in range(n_lanes)])[:size] for i, size in enumerate(sizes)]

    def swap_sizes(self, n: int, peers: Sequence[int]) -> list[int]:
        """Each of ``peers``' (member ranks) payload size, sent to this member as ``n`` goes to them, on lane 0."""
        mine = torch.tensor([n], dtype=torch.int64)
        out = [torch.empty(1, dtype=torch.int64) for _ in peers]
        works = [w for p, buf in zip(peers, out)
                 for w in (self.groups[0].send([mine], p, SIZE_TAG), self.groups[0].recv([buf], p, SIZE_TAG))]
        for w in works:
            w.wait()
        return [int(t.item()) for t in out]

    def swap(self, payload: torch.Tensor, peers: Sequence[int], sizes: Sequence[int]) -> list[torch.Tensor]:
        """Send ``payload`` to each of ``peers`` (member ranks) and receive each one's (of ``sizes``),
        a piece per lane in parallel; in ``peers``' order. Between two members the directed groups
        carry each direction on its own connection."""
        if self.directed and len(peers) == 1:
            both = [sizes[0], sizes[0]]
            both[self.rank] = payload.numel()
            return [self._pairwise(payload, both)[peers[0]]]
        received = [torch.empty(size, dtype=torch.uint8) for size in sizes]
        works = []
        for k, group in enumerate(self.groups):
            a, b = self._pieces(payload.numel())[k]
            for p, buf, size in zip(peers, received, sizes):
                c, d = self._pieces(size)[k]
                if b > a:
                    works.append(group.send([payload[a:b]], p, DATA_TAG))
                if d > c:
                    works.append(group.recv([buf[c:d]], p, DATA_TAG))
        for w in works:
            w.wait()
        return received

    def broadcast_size(self, payload: torch.Tensor | None, root: int) -> int:
        """The size of member ``root``'s ``payload`` (``None`` elsewhere), on every member, on lane 0."""
        size = torch.tensor([payload.numel() if self.rank == root and payload is not None else 0], dtype=torch.int64)
        self.groups[0].broadcast([size], self._root(root)).wait()
        return int(size.item())

    def broadcast(self, payload: torch.Tensor | None, root: int, size: int) -> torch.Tensor:
        """Member ``root``'s uint8 ``payload`` of ``size`` bytes (:meth:`broadcast_size`; ``None``
        elsewhere) on every member, on lane 0."""
        buf = payload.cpu().contiguous() if self.rank == root and payload is not None else torch.empty(
            size, dtype=torch.uint8)
        self.groups[0].broadcast([buf], self._root(root)).wait()
        return buf

    @staticmethod
    def _root(root: int) -> dist.BroadcastOptions:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return opts

    @property
    def retired(self) -> int:
        """How many member sets' groups wait for an abandoned operation to end."""
        return len(self._retired)

    def _release(self) -> None:
        """Destroy the current groups (idle: every operation on them returned) and the retired ones
        whose abandoned operation has ended."""
        self.groups, self.directed = [], []
        self._retired = [(groups, ended) for groups, ended in self._retired if not ended.is_set()]

    def retire(self, ended: threading.Event) -> None:
        """Give up the current groups: an operation on them was abandoned (they are unusable) and
        ``ended`` is set when its thread ends; they are destroyed at the first :meth:`build` after
        that. The next build starts from none, on new store connections (an abandoned rendezvous may
        still be using the old ones)."""
        if self.groups:
            self._retired.append((self.groups + [g for pair in self.directed for g in pair], ended))
        self._generation += 1
        self.groups, self.directed, self._stores = [], [], []

    def close(self) -> None:
        """Destroy the idle groups and drop the store connections (groups an abandoned operation is
        still inside stay referenced until it ends)."""
        self._release()
        self._stores = []
