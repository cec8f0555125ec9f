"""Plans from the training config: ``islands.*`` (as composed by Hydra) plus the hardware figures.

:func:`inputs_from_islands` reads the same keys training does: ``sync_every``, ``fragments``,
``fragment_layout``, ``overlap_steps``, ``codec``, ``block_size``, ``error_feedback``, ``lanes``,
``balance``, ``exchange_chunk_mib``, ``sync_warmup`` and ``members[i].devices`` /
``members[i].steps_per_round``, through :class:`~lightning_islands.engine.IslandSettings` (its
defaults for keys a config does not have, its checks). :func:`prediction_for` is the one call a
validation needs: the settings of a measured run in, the prediction out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_islands.engine.settings import IslandSettings
from lightning_islands.plan.fragments import fragment_sizes
from lightning_islands.plan.hardware import ACCELERATORS
from lightning_islands.plan.inputs import LinkSpec, PlanInputs, island_specs
from lightning_islands.plan.result import PlanResult
from lightning_islands.plan.simulate import simulate

_CPU = ACCELERATORS["cpu"]


def per_island(value: float | Sequence[float], n: int, name: str) -> list[float]:
    """``value`` for each of ``n`` islands: one number for all, or a list of ``n``."""
    if isinstance(value, (int, float)):
        return [float(value)] * n
    values = [float(v) for v in value]
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ValueError(f"{name}: {len(values)} values for {n} islands; give one for all or one per island")
    return values


def _members(islands: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    members = islands.get("members")
    if not members:
        raise ValueError("islands.members is empty: the config names no island (e.g. islands=two_hetero)")
    return list(members)


def inputs_from_islands(islands: Mapping[str, Any], *, numel: int, step_seconds: float | Sequence[float],
                        link: LinkSpec, intra_bytes_per_s: float | Sequence[float] = _CPU.intra_bytes_per_s,
                        leader_bytes_per_s: float | Sequence[float] = _CPU.leader_bytes_per_s,
                        rounds: int | None = None, block_sizes: Sequence[int] | None = None,
                        exchange_path: str | None = None) -> PlanInputs:
    """A :class:`PlanInputs` from the ``islands`` config (a dict or an OmegaConf node) and the figures;
    every per-island figure is one number for all islands or one per island. ``block_sizes``: values
    of each transformer block, to split fragments by ``islands.fragment_layout`` (the rest of
    ``numel`` is spread evenly); ``None``: equal fragments. ``exchange_path``: ``leader`` or
    ``sliced`` (default: the config's ``exchange``)."""
    members = _members(islands)
    n = len(members)
    devices = [int(m.get("devices", 1)) for m in members]
    plain = OmegaConf.to_container(islands, resolve=True) if isinstance(islands, DictConfig) else dict(islands)
    settings = IslandSettings.from_mapping(plain)  # the engine's defaults and checks, as training reads them
    # a member's own steps_per_round, else the islands' (as the worker builds each island's settings)
    fixed = [m.get("steps_per_round") or settings.steps_per_round for m in members]
    specs = island_specs(devices, per_island(step_seconds, n, "step seconds"),
                         per_island(intra_bytes_per_s, n, "intra-island bandwidth"),
                         per_island(leader_bytes_per_s, n, "leader codec throughput"),
                         [None if f is None else int(f) for f in fixed])
    sizes = None
    if block_sizes is not None:
        rest = int(numel) - sum(int(b) for b in block_sizes)
        if rest < 0:
            raise ValueError(f"the blocks hold {sum(block_sizes)} values, more than numel={numel}")
        sizes = fragment_sizes([int(b) for b in block_sizes], settings.fragments, settings.fragment_layout, rest=rest)
    return PlanInputs(
        islands=specs,
        numel=int(numel),
        link=link,
        sync_every=settings.sync_every,
        fragments=settings.fragments,
        overlap_steps=settings.overlap_steps,
        codec=settings.codec,
        block_size=settings.block_size,
        error_feedback=settings.error_feedback,
        lanes=settings.lanes,
        balance=settings.balance,
        exchange_chunk_mib=settings.exchange_chunk_mib,
        fragment_sizes=sizes,
        rounds=rounds,
        sync_warmup=tuple(settings.sync_warmup or ()),
        exchange_path=exchange_path or settings.exchange,
        topology=settings.topology,
        max_staleness=settings.max_staleness,
        grace_s=settings.grace_s,
        staleness_wait_s=settings.staleness_wait_s,
        min_islands=settings.min_islands,
    )


def prediction_for(islands: Mapping[str, Any], *, numel: int, step_seconds: float | Sequence[float],
                   link_bps: float, rtt_s: float = 0.0, rounds: int | None = None,
                   tcp_window_bytes: float | None = None,
                   intra_bytes_per_s: float | Sequence[float] = _CPU.intra_bytes_per_s,
                   leader_bytes_per_s: float | Sequence[float] = _CPU.leader_bytes_per_s,
                   store_rtt_s: float | None = None) -> PlanResult:
    """The prediction for a measured run: its ``islands`` config, the model's parameter count, each
    island's measured seconds per inner step, the shaped link, and (to compare whole runs) the rounds
    it ran. The defaults of the leader's figures are this CPU machine's rough ones; pass measured ones.

    Example::

        cfg = OmegaConf.load("runs/x/job.yaml")
        pred = prediction_for(cfg.islands, numel=3_445_888, step_seconds=[0.31, 0.29],
                              link_bps=200e6, rounds=8)
        pred.utilization  # one per island, to set beside the measured compute / wall time
    """
    link = LinkSpec(bps=link_bps, rtt_s=rtt_s, tcp_window_bytes=tcp_window_bytes, store_rtt_s=store_rtt_s)
    inputs = inputs_from_islands(islands, numel=numel, step_seconds=step_seconds, link=link,
                                 intra_bytes_per_s=intra_bytes_per_s, leader_bytes_per_s=leader_bytes_per_s,
                                 rounds=rounds)
    return simulate(inputs)
