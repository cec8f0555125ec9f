"""A sampler for map-style datasets that gives every (island, rank) its own disjoint share.

How the indices are split, each epoch:

1. One order of all ``n`` indices, the same on every process of every island: ``torch.randperm(n)``
   from a generator seeded with ``seed + epoch`` (``shuffle=True``), else ``0 .. n-1``.
2. Islands first: island ``i`` of ``k`` takes the contiguous part ``[i*n//k, (i+1)*n//k)`` of that
   order, the island rule of :func:`~lightning_islands.data.corpus.shard_range`. With ``weights``
   (one per island, the same list everywhere) the parts are proportional to them instead:
   ``[floor(n*W_<i/W), floor(n*W_<=i/W))``.
3. Then ranks, as :class:`torch.utils.data.DistributedSampler` does inside one world: the island's
   part is cut to a multiple of its world size (``drop_last=True``) or padded with its own first
   indices (``drop_last=False``), and rank ``r`` takes every ``world_size``-th index from ``r``.

So one island (``num_islands=1``) samples exactly like ``DistributedSampler(seed=seed,
drop_last=drop_last)`` (mind the defaults: ``drop_last`` is True here, False there); the
islands' parts are disjoint and cover the dataset, whatever each island's size; inside an island
every rank gets the same number of indices (sharded models need every rank to run the same steps).

Why islands split equally by default, not by their sizes: an island knows its own world size but
not the others', and shares computed from a wrong guess would overlap. The equal split needs only
the island count. Islands of different sizes then go through their parts at different speeds (an
island of 2 ranks finishes its half in half the steps of an island of 1 with the same batch size,
and starts its next epoch); the rounds' merge is weighted by the tokens each island trained, so
every island still counts for what it did. To give every sample the same rate, pass
``weights`` proportional to each island's samples per step (world size x batch size), e.g.
``weights=[2, 1]`` for islands of 2 and 1 ranks: then every rank's epoch has about the same length.

Shares are disjoint within one epoch. Islands that go through their parts at different speeds
reach their next epoch (its new order) at different steps, and from then on one island's epoch
``e + 1`` may hold samples another island still reads in epoch ``e``; with ``weights`` as above the
islands change epochs at about the same step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence, Sized
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from lightning_islands.link.coordinator import ENV_ISLAND, ENV_NUM_ISLANDS


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError as err:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from err


def island_from_env(island: int | None = None, num_islands: int | None = None) -> tuple[int, int]:
    """``(island, num_islands)``: each argument, else ``LI_ISLAND``/``LI_NUM_ISLANDS`` (as
    ``lightning-islands run`` sets them and :class:`~lightning_islands.IslandStrategy` reads them),
    else island 0 of 1. A ValueError names an index out of range."""
    island = island if island is not None else (_env_int(ENV_ISLAND) or 0)
    num_islands = num_islands if num_islands is not None else (_env_int(ENV_NUM_ISLANDS) or 1)
    if num_islands < 1 or not 0 <= island < num_islands:
        raise ValueError(f"island index {island} is outside [0, num_islands={num_islands})")
    return island, num_islands


def rank_from_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: each argument, else the island's own torch.distributed world when it
    is initialized, else rank 0 of 1. A ValueError names a rank out of range."""
    initialized = dist.is_available() and dist.is_initialized()
    rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
    world_size = world_size if world_size is not None else (dist.get_world_size() if initialized else 1)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    return rank, world_size


def island_bounds(n: int, num_islands: int, weights: Sequence[float] | None = None) -> list[int]:
    """The ``num_islands + 1`` boundaries of the islands' parts of ``n`` indices: island ``i`` owns
    positions ``[b[i], b[i+1])``. Equal parts (``i*n//k``) without ``weights``, else parts
    proportional to them, computed exactly (every process gets the same boundaries)."""
    if weights is None:
        return [i * n // num_islands for i in range(num_islands + 1)]
    if len(weights) != num_islands:
        raise ValueError(f"weights has {len(weights)} entries for {num_islands} islands; give one per island")
    exact = [Fraction(w) for w in weights]  # floats convert exactly: no rounding differs between machines
    if any(w <= 0 for w in exact):
        raise ValueError(f"weights must all be positive, got {list(weights)}")
    total, running, bounds = sum(exact), Fraction(0), [0]
    for w in exact:
        running += w
        bounds.append(math.floor(n * running / total))
    return bounds


class IslandSampler(Sampler[int]):
    """Indices of a map-style dataset for one rank of one island: every (island, rank) a disjoint share.

    The split (module docstring): one order of all indices (shuffled by ``seed + epoch``), a
    contiguous part per island (equal, or proportional to ``weights``), then the island's part
    dealt to its ranks like :class:`~torch.utils.data.DistributedSampler`. Use it with
    ``Trainer(use_distributed_sampler=False)``, and build it where the island's world exists
    (``train_dataloader``), or pass ``rank``/``world_size``. Lightning calls :meth:`set_epoch`.

    Args:
        dataset_or_len: the dataset (anything with ``len``) or its length.
        island, num_islands: default ``LI_ISLAND``/``LI_NUM_ISLANDS``, else 0 and 1.
        rank, world_size: this process in its island; default the initialized torch.distributed
            world, else 0 and 1. With tensor parallelism pass the data-parallel rank and size
            (``trainer.strategy.distributed_sampler_kwargs``, or use :meth:`for_trainer`).
        shuffle: a new order every epoch (from ``seed + epoch``); ``False``: ``0 .. n-1``.
        seed: the same on every island, or the shares overlap.
        drop_last: ``True``: drop the last ``< world_size`` indices of the island's part so every
            rank gets as many; ``False``: repeat the part's first indices instead.
        weights: one positive number per island (the same list on every island): island parts
            proportional to them; ``None``: equal parts.
    """

    def __init__(self, dataset_or_len: Sized | int, *, island: int | None = None, num_islands: int | None = None,
                 rank: int | None = None, world_size: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, weights: Sequence[float] | None = None) -> None:
        self.n = dataset_or_len if isinstance(dataset_or_len, int) else len(dataset_or_len)
        if self.n < 0:
            raise ValueError(f"dataset length must be >= 0, got {self.n}")
        self.island, self.num_islands = island_from_env(island, num_islands)
        self.rank, self.world_size = rank_from_world(rank, world_size)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.weights = list(weights) if weights is not None else None
        bounds = island_bounds(self.n, self.num_islands, self.weights)
        self.part_start, self.part_end = bounds[self.island], bounds[self.island + 1]
        self.epoch = 0
        if len(self) == 0:
            raise ValueError(
                f"island {self.island} of {self.num_islands} gets {self.part_end - self.part_start} of {self.n} "
                f"samples, too few for its {self.world_size} ranks to get one each (drop_last={drop_last}); "
                "use a larger dataset, fewer ranks, or other weights")

    @classmethod
    def for_trainer(cls, dataset_or_len: Sized | int, trainer: Any, **kwargs: Any) -> IslandSampler:
        """A sampler for ``trainer``'s process: the island of its strategy (``island_index``,
        ``num_islands``; else the environment) and its data-parallel rank and size
        (``distributed_sampler_kwargs``: tensor-parallel ranks read the same samples). ``kwargs``
        as the constructor's, and they win."""
        strategy = trainer.strategy
        found: dict[str, Any] = {"island": getattr(strategy, "island_index", None),
                                 "num_islands": getattr(strategy, "num_islands", None)}
        try:
            sampler_kwargs = strategy.distributed_sampler_kwargs or {}
        except (AttributeError, AssertionError):  # a strategy without a world (single device)
            sampler_kwargs = {}
        found["rank"] = sampler_kwargs.get("rank")
        found["world_size"] = sampler_kwargs.get("num_replicas")
        return cls(dataset_or_len, **{**found, **kwargs})

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next iteration on (call it with the same epoch on
        every rank of every island)."""
        self.epoch = epoch

    def __len__(self) -> int:
        part = self.part_end - self.part_start
        if self.drop_last or part == 0:
            return part // self.world_size
        return math.ceil(part / self.world_size)

    def order(self) -> torch.Tensor:
        """All ``n`` indices in this epoch's order (the same on every process)."""
        if not self.shuffle:
            return torch.arange(self.n)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=generator)

    def indices(self) -> list[int]:
        """This rank's indices for the current epoch, in the order they are drawn."""
        part = self.order()[self.part_start:self.part_end]
        total = len(self) * self.world_size
        if total > len(part):  # drop_last=False: pad with the part's own first indices
            repeats = math.ceil(total / len(part))
            part = part.repeat(repeats)
        return part[:total][self.rank::self.world_size].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())
