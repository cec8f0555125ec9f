"""Test doubles of the engine's two interfaces, for islands and ranks that are threads of one test.

- :class:`MemoryLink` implements the link's :class:`~lightning_islands.link.protocol.Link`
  between islands in memory (every call is a keyed meeting of all islands, like the store's keys
  and the lanes' collectives), counting bytes as the real link does.
- :class:`ThreadGroup` implements :class:`~lightning_islands.engine.group.IslandGroup` between the
  ranks of one island (queues for send/recv, a barrier for the collectives).

Every wait has a timeout, so a bug fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_islands.link.protocol import IslandAborted, LinkStats, PayloadRefused, RoundLost

WAIT_S = 60.0


class Hub:
    """Where the :class:`MemoryLink` of every island meets."""

    def __init__(self, num_islands: int) -> None:
        self.num_islands = num_islands
        self.cond = threading.Condition()
        self.posts: dict[str, dict[int, Any]] = {}
        self.aborted: dict[int, str] = {}

    def meet(self, key: str, island: int, value: Any, needed: Sequence[int] | None = None) -> dict[int, Any]:
        """Post ``value`` under ``key``; wait until every island in ``needed`` (default: all) posted."""
        needed = range(self.num_islands) if needed is None else needed
        with self.cond:
            self.posts.setdefault(key, {})[island] = value
            self.cond.notify_all()
            ok = self.cond.wait_for(lambda: self._failed(island) or all(i in self.posts[key] for i in needed),
                                    timeout=WAIT_S)
            failed = self._failed(island)
            if failed:
                raise IslandAborted(failed)
            if not ok:
                raise TimeoutError(f"islands {[i for i in needed if i not in self.posts[key]]} never reached {key!r}")
            return dict(self.posts[key])

    def _failed(self, island: int) -> str | None:
        return next((f"island {i} failed: {m}" for i, m in self.aborted.items() if i != island), None)


class MemoryLink:
    """One island's end of an in-memory link (see the module docstring)."""

    def __init__(self, hub: Hub, island: int) -> None:
        self.hub, self.island, self.num_islands = hub, island, hub.num_islands
        self.stats = LinkStats()
        self._calls = 0
        self.lanes_open = False
        self.present = tuple(range(self.num_islands))  # every island, every round: no one is lost in memory
        self.roster = self.present  # no island joins or retires in memory
        self.lanes_key = None

    def open_lanes(self) -> None:
        self.lanes_open = True

    def meet_round(self, round_: int, header: dict) -> list[dict | None]:
        return self.gather_objects(f"round{round_}", header)

    def settle_round(self) -> None:
        pass

    def end_run(self, round_: int) -> None:
        pass

    def rejoin(self, timeout_s: float, from_round: int = 0, every: int = 1) -> int:
        raise NotImplementedError("islands in memory never restart")

    def retire_after(self, round_: int) -> None:
        raise NotImplementedError("islands in memory never retire")

    def publish(self, key: str, obj: object) -> None:
        with self.hub.cond:
            self.hub.posts.setdefault(f"published/{key}", {})[self.island] = json.dumps(obj)

    def read_object(self, key: str, timeout_s: float) -> object:
        with self.hub.cond:
            found = self.hub.posts.get(f"published/{key}", {})
            return json.loads(next(iter(found.values()))) if found else None

    def membership_changes(self) -> list[str]:
        return []

    def gather_objects(self, key: str, obj: object) -> list:
        posts = self.hub.meet(f"obj/{key}", self.island, json.dumps(obj))
        return [json.loads(posts[i]) for i in range(self.num_islands)]

    def _next(self, kind: str) -> str:
        assert self.lanes_open, "payloads move only after the lanes are open"
        self._calls += 1
        return f"{kind}/{self._calls}"

    def _check(self, sizes: dict[int, int], limit: int | None) -> None:
        bad = {i: n for i, n in sizes.items() if i != self.island and limit is not None and n > limit}
        if bad:
            raise PayloadRefused(f"island(s) {sorted(bad)} announced {sorted(bad.values())} bytes, above {limit}")

    def all_gather_bytes(self, payload: torch.Tensor, limit: int | None = None) -> list[torch.Tensor]:
        posts = self.hub.meet(self._next("gather"), self.island, payload.detach().cpu().clone())
        out = [posts[i] for i in range(self.num_islands)]
        self._check({i: t.numel() for i, t in enumerate(out)}, limit)
        self.stats.bytes_sent += payload.numel() * (self.num_islands - 1)
        self.stats.bytes_received += sum(t.numel() for i, t in enumerate(out) if i != self.island)
        return out

    def broadcast_bytes(self, payload: torch.Tensor | None, src: int = 0, limit: int | None = None) -> torch.Tensor:
        key = self._next("broadcast")
        value = payload.detach().cpu().clone() if self.island == src else None
        posts = self.hub.meet(key, self.island, value, needed=[src])
        self._check({src: posts[src].numel()}, limit)
        if self.island == src:
            self.stats.bytes_sent += value.numel() * (self.num_islands - 1)
        else:
            self.stats.bytes_received += posts[src].numel()
        return posts[src]

    def swap_bytes(self, payload: torch.Tensor, peers: Sequence[int], limit: int | None = None
                   ) -> dict[int, torch.Tensor]:
        call, got = self._next("swap"), {}
        for p in sorted(set(peers) - {self.island}):  # one meeting per pair, in island order: no cycle waits
            pair = sorted((self.island, p))
            posts = self.hub.meet(f"{call}/{pair[0]}-{pair[1]}", self.island, payload.detach().cpu().clone(),
                                  needed=pair)
            got[p] = posts[p]
        self._check({i: t.numel() for i, t in got.items()}, limit)
        self.stats.bytes_sent += payload.numel() * len(got)
        self.stats.bytes_received += sum(t.numel() for t in got.values())
        return got

    def take_stats(self) -> LinkStats:
        stats, self.stats = self.stats, LinkStats()
        return stats

    def add_wait(self, seconds: float) -> None:
        self.stats.seconds_waiting += seconds

    def fail_round(self, why: str) -> RoundLost:
        return RoundLost(why)  # islands in memory run no second attempt: the test sees the error

    def heartbeat(self, status: dict) -> None:
        pass  # islands in memory never go silent

    def beating(self, status: dict, period: float | None = None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        pass

    def abort(self, message: str) -> None:
        with self.hub.cond:
            self.hub.aborted[self.island] = message
            self.hub.cond.notify_all()


class MemoryRankLink:
    """Rank ``rank`` of island ``island``'s own lanes in memory (a
    :class:`~lightning_islands.link.protocol.RankLink`): its meetings are keyed by its rank, so each
    rank meets only the same rank of the other islands. ``fail_at``: the call (1, 2, ...) of
    :meth:`all_gather_bytes` that loses its peer (raises :class:`RoundLost`), for fault tests."""

    def __init__(self, hub: Hub, island: int, rank: int, fail_at: int | None = None) -> None:
        self.hub, self.island, self.rank, self.fail_at = hub, island, rank, fail_at
        self.present: tuple[int, ...] = tuple(range(hub.num_islands))
        self.stats = LinkStats()
        self._calls = 0
        self.used: list[tuple[tuple[int, ...], str | None]] = []

    def use(self, present: tuple[int, ...], lanes_key: str | None, attempt: str | None = None) -> None:
        if self.used and lanes_key != self.used[-1][1]:  # new lanes: their calls count from one again
            self._calls = 0
        self.present = tuple(present)
        self.used.append((self.present, lanes_key))

    def all_gather_bytes(self, payload: torch.Tensor, limit: int | None = None) -> list[torch.Tensor]:
        self._calls += 1
        if self._calls == self.fail_at:
            raise RoundLost(f"rank {self.rank} of island {self.island} lost its peer (injected)")
        lanes = self.used[-1][1] if self.used else None
        posts = self.hub.meet(f"rank{self.rank}/{lanes}/gather/{self._calls}", self.island,
                              payload.detach().cpu().clone(), needed=self.present)
        out = [posts.get(i, torch.empty(0, dtype=torch.uint8)) for i in range(self.hub.num_islands)]
        self.stats.bytes_sent += payload.numel() * (len(self.present) - 1)
        self.stats.bytes_received += sum(t.numel() for i, t in enumerate(out) if i != self.island)
        return out

    def swap_bytes(self, payload: torch.Tensor, peers: Sequence[int], limit: int | None = None
                   ) -> dict[int, torch.Tensor]:
        self._calls += 1
        lanes, got = self.used[-1][1] if self.used else None, {}
        for p in sorted(set(peers) & set(self.present) - {self.island}):  # one meeting per pair, in island order
            pair = sorted((self.island, p))
            posts = self.hub.meet(f"rank{self.rank}/{lanes}/swap/{self._calls}/{pair[0]}-{pair[1]}", self.island,
                                  payload.detach().cpu().clone(), needed=pair)
            got[p] = posts[p]
        self.stats.bytes_sent += payload.numel() * len(got)
        self.stats.bytes_received += sum(t.numel() for t in got.values())
        return got

    def take_stats(self) -> LinkStats:
        stats, self.stats = self.stats, LinkStats()
        return stats

    def close(self) -> None:
        pass


class ThreadIsland:
    """What the ranks (threads) of one island share."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.queues = {(s, d): queue.Queue() for s in range(size) for d in range(size)}
        self.barrier = threading.Barrier(size, timeout=WAIT_S)
        self.slots: list[Any] = [None] * size
        self.lock = threading.Lock()
        self.second: ThreadIsland | None = None  # the ranks' second group (ThreadGroup.split)


class ThreadGroup:
    """One rank of a :class:`ThreadIsland` (see the module docstring)."""

    def __init__(self, shared: ThreadIsland, rank: int) -> None:
        self.shared, self.rank, self.size = shared, rank, shared.size

    def transfer_device(self, device: torch.device) -> torch.device:
        return device

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.shared.queues[self.rank, dst].put(tensor.detach().clone())

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        got = self.shared.queues[src, self.rank].get(timeout=WAIT_S)
        assert got.shape == tensor.shape, f"rank {self.rank} expected {tuple(tensor.shape)} from {src}, got {got.shape}"
        tensor.copy_(got)

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
        for dst, t in sends:  # a queue never blocks a sender
            self.send(t, dst)
        for src, t in recvs:
            self.recv(t, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.shared.slots[self.rank] = obj
        self.shared.barrier.wait()
        out = list(self.shared.slots)
        self.shared.barrier.wait()
        return out

    def sum(self, values: Sequence[float]) -> list[float]:
        rows = self.all_gather_object([float(v) for v in values])
        return [float(torch.tensor(col, dtype=torch.float64).sum()) for col in zip(*rows)] if rows[0] else []

    def max_int(self, value: int) -> int:
        return max(self.all_gather_object(int(value)))

    def broadcast_object(self, obj: Any) -> Any:
        return self.all_gather_object(obj)[0]

    def split(self) -> ThreadGroup:
        with self.shared.lock:
            if self.shared.second is None:
                self.shared.second = ThreadIsland(self.size)
        return ThreadGroup(self.shared.second, self.rank)


def run_threads(targets: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run each target in its own thread; their results in order, or the first error re-raised."""
    results: list[Any] = [None] * len(targets)
    errors: list[BaseException | None] = [None] * len(targets)

    def wrap(k: int) -> None:
        try:
            results[k] = targets[k]()
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
            errors[k] = err

    threads = [threading.Thread(target=wrap, args=(k,), daemon=True) for k in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=5 * WAIT_S)
        assert not t.is_alive(), "a thread of the test hung"
    for err in errors:
        if err is not None:
            raise err
    return results
