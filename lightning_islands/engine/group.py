"""What the engine needs from the world it runs in: the island's own ranks, and the link to the others.

Two small interfaces, so that the round can run in a real torch.distributed world (the Lightning
strategy), in one process (an island of one rank), or between threads of one test:

- :class:`IslandGroup`, the ranks of one island: point-to-point sends for the canonical layout's
  gather and scatter, a float sum, and an object broadcast from the leader. :class:`TorchGroup` is
  the default process group; :class:`SoloGroup` an island of one process.
- :class:`Link`, the leader's connection to the other islands:
  :class:`~lightning_islands.transport.IslandLink` over the coordinator and gloo lanes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor


class IslandGroup(Protocol):
    """The ranks of one island (rank 0 is its leader). Every call is a collective of the island,
    except :meth:`send` and :meth:`recv`, which pair up."""

    rank: int
    size: int

    def transfer_device(self, device: torch.device) -> torch.device:
        """Where tensors given to :meth:`send` and :meth:`recv` must live when the island computes
        on ``device``."""
        ...

    def send(self, tensor: Tensor, dst: int) -> None:
        """Send ``tensor`` to rank ``dst`` of the island."""
        ...

    def recv(self, tensor: Tensor, src: int) -> None:
        """Receive into ``tensor`` from rank ``src`` of the island."""
        ...

    def sum(self, values: Sequence[float]) -> list[float]:
        """Elementwise sum of ``values`` over the island's ranks (float64), on every rank."""
        ...

    def max_int(self, value: int) -> int:
        """The largest ``value`` over the island's ranks, on every rank."""
        ...

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (picklable)."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        ...


class Link(Protocol):
    """The leader's connection to the other islands (see :class:`~lightning_islands.transport.IslandLink`)."""

    island: int
    num_islands: int
    present: tuple[int, ...]  # the islands of the current round (all of them before the first)
    lanes_key: str | None  # changes whenever the lanes are rebuilt for another member set

    def open_lanes(self) -> None:
        """Open the streams payloads travel on (after the fingerprints agreed)."""
        ...

    def meet_round(self, round_: int, header: dict) -> list[dict | None]:
        """Every island's header of round ``round_`` in island order (``None``: not present), in the
        wire form this island sends (:meth:`~lightning_islands.engine.header.RoundHeader.to_wire`);
        the member set is decided here (:mod:`lightning_islands.membership`)."""
        ...

    def settle_round(self) -> None:
        """This island finished the round's exchange: return once the round counts for every
        member, or raise :class:`~lightning_islands.membership.RoundLost` (run it again)."""
        ...

    def end_run(self, round_: int) -> None:
        """Round ``round_`` was the run's last (an island still rejoining stops)."""
        ...

    def rejoin(self, timeout_s: float) -> int:
        """A restarted island asks to be taken back; the round it is taken into."""
        ...

    def membership_changes(self) -> list[str]:
        """The member-set changes seen since the last call (for the log)."""
        ...

    def gather_objects(self, key: str, obj: object) -> list:
        """Every island's JSON-able ``obj`` under ``key``, in island order."""
        ...

    def all_gather_bytes(self, payload: Tensor) -> list[Tensor]:
        """Every island's 1-D uint8 payload, in island order."""
        ...

    def broadcast_bytes(self, payload: Tensor | None, src: int = 0) -> Tensor:
        """Island ``src``'s uint8 payload on every island."""
        ...

    def take_stats(self) -> Any:
        """Bytes and seconds moved since the last call (``bytes_sent``, ``bytes_received``,
        ``seconds_exchanging``, ``seconds_waiting``)."""
        ...

    def add_wait(self, seconds: float) -> None:
        """Count ``seconds`` as time spent waiting for other islands."""
        ...

    def abort(self, message: str) -> None:
        """Tell the other islands that this one failed."""
        ...


class SoloGroup:
    """An island of one process: every collective is the identity."""

    rank = 0
    size = 1

    def transfer_device(self, device: torch.device) -> torch.device:
        return device

    def send(self, tensor: Tensor, dst: int) -> None:
        raise RuntimeError("an island of one process has no other rank to send to")

    def recv(self, tensor: Tensor, src: int) -> None:
        raise RuntimeError("an island of one process has no other rank to receive from")

    def sum(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def max_int(self, value: int) -> int:
        return int(value)

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


class TorchGroup:
    """The island as torch.distributed's default process group (its world is the island).

    ``device``: where the island computes (collectives of NCCL need tensors there).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.size > 1 else 0

    def transfer_device(self, device: torch.device) -> torch.device:
        # gloo's send and recv take CPU tensors only (an island that trains on GPUs over gloo)
        return torch.device("cpu") if self.size > 1 and dist.get_backend() == "gloo" else device

    def send(self, tensor: Tensor, dst: int) -> None:
        dist.send(tensor, dst=dst)

    def recv(self, tensor: Tensor, src: int) -> None:
        dist.recv(tensor, src=src)

    def sum(self, values: Sequence[float]) -> list[float]:
        if self.size == 1:
            return [float(v) for v in values]
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return [float(v) for v in t.tolist()]

    def max_int(self, value: int) -> int:
        if self.size == 1:
            return int(value)
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def broadcast_object(self, obj: Any) -> Any:
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out
