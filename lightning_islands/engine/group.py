"""What the engine needs from the island it runs in: its own ranks.

A small interface, so that the round can run in a real torch.distributed world (the Lightning
strategy), in one process (an island of one rank), or between threads of one test:

- :class:`IslandGroup`, the ranks of one island: point-to-point sends for the canonical layout's
  gather and scatter, a float sum, and an object broadcast from the leader. :class:`TorchGroup` is
  the default process group; :class:`SoloGroup` an island of one process.
- The leader's connection to the other islands is the link package's
  :class:`~lightning_islands.link.protocol.Link`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
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

    def exchange(self, sends: Sequence[tuple[int, Tensor]], recvs: Sequence[tuple[int, Tensor]]) -> None:
        """Send each ``(rank, tensor)`` of ``sends`` and receive into each of ``recvs``, all at once
        (an all-to-all of the ranks taking part; at most one message each way between two ranks)."""
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

    def split(self) -> IslandGroup:
        """A second group of the same ranks, whose collectives run beside this one's without meeting
        them (an overlapped sliced round's thread uses it while training uses this one). A
        collective: every rank calls it once, at the same point."""
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

    def exchange(self, sends: Sequence[tuple[int, Tensor]], recvs: Sequence[tuple[int, Tensor]]) -> None:
        if sends or recvs:
            raise RuntimeError("an island of one process has no other rank to exchange with")

    def sum(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def max_int(self, value: int) -> int:
        return int(value)

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def split(self) -> SoloGroup:
        return SoloGroup()


class TorchGroup:
    """The island as torch.distributed's default process group (its world is the island), or as
    ``group``, a process group of the same ranks (:meth:`split`).

    ``device``: where the island computes (collectives of NCCL need tensors there); ``timeout``: that
    of the island's collectives, which a :meth:`split` group takes too (default: torch's).
    """

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None,
                 timeout: timedelta | None = None) -> None:
        self.device, self.group, self.timeout = device, group, timeout
        self.size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.size > 1 else 0

    def _backend(self) -> str:
        return str(dist.get_backend(self.group))

    def transfer_device(self, device: torch.device) -> torch.device:
        # gloo's send and recv take CPU tensors only (an island that trains on GPUs over gloo)
        return torch.device("cpu") if self.size > 1 and self._backend() == "gloo" else device

    def _math_device(self) -> torch.device:
        return torch.device("cpu") if self._backend() == "gloo" else self.device

    def send(self, tensor: Tensor, dst: int) -> None:
        dist.send(tensor, dst=dst, group=self.group)

    def recv(self, tensor: Tensor, src: int) -> None:
        dist.recv(tensor, src=src, group=self.group)

    def exchange(self, sends: Sequence[tuple[int, Tensor]], recvs: Sequence[tuple[int, Tensor]]) -> None:
        ops = [dist.P2POp(dist.isend, t, dst, group=self.group) for dst, t in sends]
        ops += [dist.P2POp(dist.irecv, t, src, group=self.group) for src, t in recvs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def sum(self, values: Sequence[float]) -> list[float]:
        if self.size == 1:
            return [float(v) for v in values]
        t = torch.tensor(list(values), dtype=torch.float64, device=self._math_device())
        dist.all_reduce(t, group=self.group)
        return [float(v) for v in t.tolist()]

    def max_int(self, value: int) -> int:
        if self.size == 1:
            return int(value)
        t = torch.tensor([value], dtype=torch.int64, device=self._math_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def broadcast_object(self, obj: Any) -> Any:
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def split(self) -> TorchGroup:
        """A gloo group of the island's ranks (CPU transfers, whatever the default backend: an
        overlapped round's thread moves its chunks through host memory)."""
        if self.size == 1:
            return TorchGroup(self.device, timeout=self.timeout)
        return TorchGroup(self.device, dist.new_group(backend="gloo", timeout=self.timeout), self.timeout)
