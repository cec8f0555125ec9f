"""An island's engine around its rounds: its state, the rendezvous, the global model, checkpoints.

:class:`IslandEngineBase` holds what every round reads and writes (the settings, the canonical
layouts of the model and its fragments, the outer state, the schedule, the codec, the leader's
:class:`~lightning_islands.engine.meeting.RoundMeeting` and the round's counters) and everything
the engine does outside a round: the islands meet and agree on where they start
(:mod:`lightning_islands.engine.rendezvous`), the global model is read back, and a checkpoint saves
and restores the outer state. The round's sequence is :class:`~lightning_islands.engine.round.IslandEngine`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_islands.engine import rendezvous
from lightning_islands.engine.butterfly import Butterfly
from lightning_islands.engine.checkpoint import load_outer_state, save_outer_state
from lightning_islands.engine.fragments import split_fragments
from lightning_islands.engine.island import Island
from lightning_islands.engine.layout import CanonicalLayout
from lightning_islands.engine.meeting import RoundMeeting
from lightning_islands.engine.schedule import Schedule
from lightning_islands.engine.settings import GRACE_FLOOR_S, IslandSettings
from lightning_islands.engine.state import OuterState, base_key
from lightning_islands.link.protocol import Link, RankLink, RoundLost


class IslandEngineBase:
    """One rank's engine of one island outside its rounds (:class:`~lightning_islands.engine.round.IslandEngine`
    adds the round).

    Args:
        settings: the islands' settings.
        layout: the canonical layout of the model's parameters over this island's ranks.
        island: this island's index; ``num_islands``: how many take part.
        device: where the island computes (its local shards live there).
        exchange_device: where the leader encodes, decodes and merges a chunk.
    """

    def __init__(self, settings: IslandSettings, layout: CanonicalLayout, island: int, num_islands: int,
                 device: torch.device, exchange_device: torch.device) -> None:
        self.settings, self.layout, self.group = settings, layout, layout.group
        self.island, self.num_islands = island, num_islands
        self.side = Island(island, num_islands, layout.group)
        self.device, self.exchange_device = device, exchange_device
        self.codec = settings.make_codec()
        fragments = split_fragments([e.name for e in layout.entries], [e.numel for e in layout.entries],
                                    settings.fragments, settings.fragment_layout)
        self.fragment_layouts = [layout] if len(fragments) == 1 else [layout.subset(f) for f in fragments]
        # a lone island has no stage to mix at: it runs the all-reduce's round (with itself)
        self.butterfly = Butterfly(num_islands) if settings.topology == "butterfly" and num_islands > 1 else None
        self.state = OuterState([settings.outer_optimizer() for _ in fragments], settings.outer_device,
                                fragments if len(fragments) > 1 else None,
                                self.butterfly.stages if self.butterfly is not None else 0)
        self.schedule = Schedule(settings, island)
        self.meeting = RoundMeeting(self.side, settings, self.codec, layout)
        self.round_tokens = 0  # this rank's tokens in the current round
        # the island's tokens (and tokens per expert) of each of the last F - 1 rounds: a fragment's merge
        # weights count what the island trained since that fragment last synced
        self.recent_rounds: list[dict[str, Any]] = []
        self.last_round_metrics: dict[str, float] = {}
        self.initial_state_broadcast: bool | None = None  # whether island 0's state had to be sent
        self.joining = False  # (re)joining: the next round replaces this island's global state
        self._step_seconds = 0.0  # the last round's seconds per inner step (the default grace window)
        self._state_exchanges = 0
        # max_staleness: the checksum of each fragment's global state at its last outer step counts
        self.recent_states: dict[int, dict[int, int]] = {}
        self.rank_link: RankLink | None = None  # exchange=sliced: this rank's own lanes (not the leader's)
        # exchange=sliced: the lanes key of the last round's rank lanes, and the one a repair transfer lost
        # after its round counted left broken on some rank (the next round under it runs on new lanes)
        self._lanes_key: str | None = None
        self._broken_lanes: str | None = None
        self._flight_side: Island | None = None  # exchange=sliced with overlap: the island over a second group

    @property
    def link(self) -> Link | None:
        """The leader's link to the other islands, once they have met (``None`` elsewhere)."""
        return self.side.link

    @link.setter
    def link(self, link: Link | None) -> None:
        self.side.link = link

    @property
    def totals(self) -> dict[str, float]:
        """What the link moved over the run: bytes and seconds (the leader's)."""
        return self.meeting.totals

    @totals.setter
    def totals(self, totals: dict[str, float]) -> None:
        self.meeting.totals = totals

    @property
    def is_leader(self) -> bool:
        """Whether this rank is its island's leader (the one that talks to other islands)."""
        return self.side.is_leader

    @property
    def sliced(self) -> bool:
        """Whether every rank moves its own slice of a round (``exchange=sliced``; a lone island's
        slices merge with nobody, but no rank holds the fragment either)."""
        return self.settings.exchange == "sliced"

    def flight_side(self) -> Island:
        """The island over a second group of its ranks, for an overlapped sliced round's thread
        (made at the first such round: a collective of the island), sharing the leader's link."""
        if self._flight_side is None:
            self._flight_side = Island(self.island, self.num_islands, self.group.split())
        self._flight_side.link = self.link
        return self._flight_side

    def grace_s(self) -> float:
        """How long a round waits for an island that shows no sign of life: ``grace_s``, else the
        expected length of a round (this island's last one), at least 10 s."""
        if self.settings.grace_s is not None:
            return float(self.settings.grace_s)
        return max(GRACE_FLOOR_S, self.schedule.steps_per_round * self._step_seconds)

    def rank_lanes(self, count: int, side: Island | None = None) -> tuple[Any, tuple[str, str] | None]:
        """This rank's lanes for a round of ``count`` slices (the island's link on rank 0, its own
        beyond, ``None`` past ``count``), brought to the round's islands present (a collective of the
        island); and why they could not be, if so (the island then fails together, not this rank alone).
        ``side``: the island over the group that runs the transfer (default: its own)."""
        side, rank, link = side or self.side, self.group.rank, None
        present, key, attempt = side.with_link(lambda link: ((side.index,), None, None) if link is None else (
            tuple(link.present), link.lanes_key, getattr(link, "attempt_key", None)))  # None: a lone island
        if rank == 0:
            link = self.link
        elif rank < count and self.rank_link is not None:  # without one the island fails together (sliced)
            link = self.rank_link
        broken, self._broken_lanes, self._lanes_key = key is not None and key == self._broken_lanes, None, key
        if broken and link is not None and rank:  # its peers would wait for it to build them anew under a used key
            return link, ("lost", f"rank {rank} of island {self.island} lost its lanes of {key} in the last repair; "
                                  "the round runs again on new ones")
        try:
            if link is not None and rank:
                link.use(present, key, attempt)
        except RoundLost as err:
            return link, ("lost", str(err))
        except Exception as err:  # noqa: BLE001 - e.g. a bad LI_LINK_IFNAME: the island ends together
            return link, (type(err).__name__, f"{type(err).__name__}: {err}")
        return link, None

    # ------------------------------------------------------------------ before the rounds
    def meet(self, open_link: Callable[[], Link], fingerprint: dict[str, Any], rejoining: bool = False,
             joining: bool = False, open_rank_link: Callable[[], RankLink] | None = None) -> None:
        """Meet the other islands and compare fingerprints (:func:`rendezvous.meet`); ``joining``: this
        island is new to a run under way (it compares with the run's record). ``open_rank_link``: with
        ``exchange=sliced``, opens this rank's own lanes (ranks other than the leader; each rank's
        own, since any of them may own a slice once the islands present are known)."""
        if joining and self.butterfly is not None:
            raise ValueError(f"island {self.island} cannot join a run under way with topology=butterfly yet (its "
                             "groups are fixed by the islands the run started with); start the run with every island, "
                             "or use topology=allreduce")
        rendezvous.meet(self.side, open_link, fingerprint, rejoining, joining, dataclasses.asdict(self.settings))
        if self.settings.exchange == "sliced" and not self.is_leader and open_rank_link is not None:
            self.rank_link = open_rank_link()

    def adopt_initial_state(self, locals_: Sequence[Tensor], buffers: dict[str, Tensor]) -> None:
        """Every island takes island 0's parameters and buffers (:func:`rendezvous.adopt_initial_state`);
        call it again after loading a plain checkpoint."""
        if self.num_islands == 1:
            self.state.set_anchors(locals_)
            return
        self._state_exchanges += 1  # each call its own key
        key = f"initial_state/{self._state_exchanges}"
        if self.sliced:
            self.initial_state_broadcast = rendezvous.adopt_initial_state_sliced(
                self.side, self.layout, self.state, self.device, locals_, buffers, key, self.rank_lanes,
                self.settings.exchange_chunk)
            return
        self.initial_state_broadcast = rendezvous.adopt_initial_state(
            self.side, self.layout, self.state, self.device, locals_, buffers, key)

    def agree_on_start(self, more: bool) -> list[int]:
        """The islands' start agreement (a collective of the island): every island's global state
        must be the same (with the butterfly, each island has its own: its partners check theirs
        against it at their stage); returns the islands that have no training steps left (``more=False``)."""
        if self.num_islands == 1:
            return [] if more else [self.island]
        digest = self._start_digest() if self.butterfly is None else None
        steps = self.state.steps()
        return rendezvous.agree_on_start(self.side, digest, self.schedule.round, more,
                                         steps if isinstance(steps, int) else sum(steps), self.settings.max_staleness)

    def _start_digest(self) -> str | None:
        """What the start agreement compares (a collective of the island): the global state's SHA-256
        (:meth:`global_state_digest`); with ``exchange=sliced``, which gathers nothing, the checksums of
        the anchors and momentum that do not depend on how the island shards them."""
        if not self.sliced:
            return self.global_state_digest()
        momentum = self.state.momentum
        sums = [self.layout.island_checksum(self.state.anchors),
                0 if momentum is None else self.layout.island_checksum(momentum)]
        return "/".join(f"{s:016x}" for s in sums) + ("" if momentum is not None else "/none")

    def settle_start(self, done: list[int]) -> tuple[bool, str | None, bool]:
        """Act on the start agreement (:func:`rendezvous.settle_start`)."""
        return rendezvous.settle_start(self.schedule, done)

    def continue_from(self, previous: IslandEngineBase) -> None:
        """Take over the rounds, outer state and link totals of an earlier engine of this island (a
        second fit with the same strategy); the anchors are taken anew from the parameters."""
        self.schedule = previous.schedule
        self.state.optimizers, self.state.residual = previous.state.optimizers, previous.state.residual
        self.recent_rounds, self.recent_states = previous.recent_rounds, previous.recent_states
        self.totals, self.last_round_metrics = previous.totals, previous.last_round_metrics
        self._state_exchanges = previous._state_exchanges

    def fingerprint(self, resuming: bool) -> dict[str, Any]:
        """What must be equal on every island (:meth:`IslandSettings.fingerprint`) for this one."""
        return self.settings.fingerprint(self.layout, resuming, self.device)

    # ------------------------------------------------------------------ global state
    @torch.no_grad()
    def global_flat(self) -> Tensor | None:
        """The global parameters as the canonical fp32 vector on the leader (``None`` on the other
        ranks); a collective of the island."""
        return self.layout.gather_to_leader(self.state.anchors, self.device)

    def global_parameters(self) -> dict[str, Tensor]:
        """The global parameters (fp32, on the host) by name on the leader, empty on the other ranks;
        a collective of the island."""
        flat = self.global_flat()
        if flat is None:
            return {}
        flat = flat.cpu()
        return {e.name: flat[e.offset : e.offset + e.numel].view(e.shape).clone() for e in self.layout.entries}

    @torch.no_grad()
    def global_state_digest(self) -> str | None:
        """SHA-256 of the global parameters and outer momentum in canonical layout, on the leader
        (``None`` on the other ranks); a collective of the island."""
        flat = self.global_flat()
        momentum = self.state.momentum
        flat_m = self.layout.gather_to_leader(momentum, self.device) if momentum is not None else None
        if flat is None:
            return None
        h = hashlib.sha256(flat.cpu().numpy().tobytes())
        if flat_m is not None:
            h.update(flat_m.cpu().numpy().tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_meta(self, resuming: bool) -> dict[str, Any]:
        """The counters a checkpoint keeps beside the outer state, its ``islands`` entry (a collective
        of the island: the round's tokens are summed over its ranks)."""
        state = self.state.state_dict()
        return {**self.schedule.state_dict(), "round_tokens": self.group.sum([self.round_tokens])[0],
                "totals": dict(self.totals), "outer_steps": state["outer_steps"],
                "recent_rounds": list(self.recent_rounds),
                "has_momentum": state["momentum"] is not None, "has_residual": state["residual"] is not None,
                "stages": len(self.state.bases),
                "recent_states": {str(f): {str(k): v for k, v in r.items()} for f, r in self.recent_states.items()},
                "island": self.island, "num_islands": self.num_islands, "fingerprint": self.fingerprint(resuming)}

    def save_checkpoint(self, path: Path, params: Sequence[Tensor]) -> None:
        """Save this rank's outer state into the checkpoint folder ``path``, placed like ``params``
        (a collective of the island)."""
        save_outer_state(path, self.state.state_dict(), params, self.layout)

    def load_checkpoint(self, path: Path, meta: dict[str, Any], params: Sequence[Tensor]) -> None:
        """Restore the outer state from the checkpoint folder ``path`` and the counters ``meta`` of
        :meth:`checkpoint_meta` (a collective of the island). A checkpoint of another
        island is refused with the fix."""
        if meta["island"] != self.island:
            raise ValueError(
                f"{path} was saved by island {meta['island']}, but this is island {self.island}; give each island "
                "its own checkpoint (resume=[...])")
        use_residual = bool(meta.get("has_residual")) and self.settings.use_error_feedback
        keys = ["anchor"] + ["momentum"] * bool(meta["has_momentum"]) + ["residual"] * use_residual
        saved_stages, stages = int(meta.get("stages", 0)), len(self.state.bases)
        if saved_stages and saved_stages != stages:
            raise ValueError(f"{path} was saved by a butterfly of {saved_stages} stage(s) (its islands' states "
                             f"differ), but this run has {stages or 'no'} stages (topology={self.settings.topology}, "
                             f"{self.num_islands} islands); resume with the topology and island count it was saved "
                             "with, or start afresh")
        keys += [base_key(k) for k in range(saved_stages)]  # none saved: the bases start from the anchors
        loaded = load_outer_state(path, keys, params, self.layout, self.state.anchors)
        self.state.load_state_dict({**loaded, "momentum": loaded.get("momentum"), "residual": loaded.get("residual"),
                                    "outer_steps": meta["outer_steps"]})
        self.schedule.load_state_dict(meta)
        self.round_tokens = int(meta["round_tokens"]) if self.is_leader else 0
        self.recent_rounds = list(meta.get("recent_rounds", []))
        self.recent_states = {int(f): {int(k): int(v) for k, v in r.items()}
                              for f, r in meta.get("recent_states", {}).items()}
        self.totals = dict(meta["totals"])

    # ------------------------------------------------------------------ the round's inputs
    def island_expert_counts(self, counts: dict[str, Tensor]) -> dict[str, list[float]]:
        """The island's tokens per expert this round, for each expert parameter of the layout that
        ``counts`` (this rank's counts by parameter name) names, summed over the island's ranks;
        empty, and no collective, when it names none (every rank alike)."""
        names = [e.name for e in self.layout.entries if e.name in counts]
        if not names:
            return {}
        rows = [counts[n].to(torch.float64).cpu().tolist() for n in names]
        summed = self.group.sum([v for row in rows for v in row])
        out, at = {}, 0
        for name, row in zip(names, rows):
            out[name], at = summed[at : at + len(row)], at + len(row)
        return out

    def count_tokens(self, tokens: int) -> None:
        """Add a batch's tokens to this rank's count for the round (the merge weight)."""
        self.round_tokens += int(tokens)
