"""The butterfly round (``topology="butterfly"``): each island mixes its proposal with its partners'.

Every island holds its own global model (the anchors) and its own outer momentum (a repair, below,
copies its group source's). A round of
fragment ``f`` at round ``r`` is stage ``k = (r // F) mod stages`` of the butterfly
(:class:`~lightning_islands.engine.butterfly.Butterfly`: islands ``i`` and ``i XOR 2**k``, extras
joined to their unit). In it each island

1. takes its own outer step on its own pseudo-gradient: its *proposal* ``P_i``;
2. sends ``Q(P_i - B_k + decay * residual)``: its proposal's distance from the stage's *base*
   ``B_k``, the state its group agreed on when it last mixed at stage ``k`` (all islands start with
   ``B_k`` = the common initial state), compressed by the codec with error feedback;
3. receives its partners' payloads only (one per round for a power of two), and every island of
   the group computes ``B_k + sum_j c_j D(payload_j)`` in island order, ``c_j`` the islands' merge
   weights (tokens, or equal) normalised over the group: the group's new global state, which
   becomes its new ``B_k`` too.

**The invariant** (instead of "every island identical after every round"): every stage keeps the
weighted sum ``sum_j w_j X_j`` of the group's reconstructed proposals ``X_j = B_k + D(payload_j)``
(float rounding aside; the tests check it against float64), the islands of a group leave the stage
bit-identical, and ``log2 N`` stages of pure mixing give every island the weighted mean of all
(:func:`~lightning_islands.engine.butterfly.mix`). The mean of the islands' models follows the
outer step on the mean pseudo-gradient (the outer SGD is linear), so the islands' average trains
as DiLoCo does while each island receives one payload instead of ``N - 1``.

**The state check** compares, within each group, the checksum of ``B_k`` (and the outer step
counts): the group's majority of voting islands (a tie: the lowest; no voting island: the lowest
present) is its source, and an island whose base differs (restarted from an older checkpoint, or
late for an earlier stage) is left out of the mix and, once the round counted, takes the source's
anchors, base and momentum before the mix lands, adopting the group's result. A group with one unit present (its partner
lost) mixes that unit alone: an island by itself takes ``B_k + D(Q(...))``, its proposal up to what
the codec held back (kept in its residual), and the base stays.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_islands.codecs import Codec
from lightning_islands.codecs.buffers import Buffers
from lightning_islands.engine import outer
from lightning_islands.engine.butterfly import Butterfly
from lightning_islands.engine.exchange import LINK_TOTALS, merge_expert_values
from lightning_islands.engine.header import RoundHeader
from lightning_islands.engine.layout import CanonicalLayout
from lightning_islands.engine.merging import MergePlan
from lightning_islands.engine.state import OuterState
from lightning_islands.engine.stats import RoundStats, _diff_sq
from lightning_islands.link.protocol import Link

if TYPE_CHECKING:
    from lightning_islands.engine.lifecycle import IslandEngineBase

log = logging.getLogger(__name__)


def stage_of(butterfly: Butterfly, round_: int, fragments: int) -> int:
    """The stage of round ``round_`` (fragments take turns, so a fragment's own count is ``round_ // F``)."""
    return butterfly.stage_of(round_ // fragments)


def present_group(butterfly: Butterfly, headers: Sequence[RoundHeader], island: int, stage: int) -> list[int]:
    """The islands of ``island``'s group at ``stage`` present in the round (``headers``), in island order."""
    return sorted(i for unit in butterfly.group(island, stage) for i in unit
                  if i < len(headers) and not headers[i].absent)


def agreement(butterfly: Butterfly, headers: Sequence[RoundHeader], stage: int
              ) -> tuple[list[int], dict[int, int], dict[int, int]]:
    """The islands whose stage base agrees with their group's source (module docstring); for every
    island whose does not, its source; and the age of each island that missed rounds (its outer step
    count behind its group's furthest: a late island). Every island derives the same from the headers."""
    agree: list[int] = []
    repairs: dict[int, int] = {}
    ages: dict[int, int] = {}
    for island in range(min(butterfly.num_islands, len(headers))):
        group = present_group(butterfly, headers, island, stage)
        if not group or group[0] != island:  # each group once, at its lowest present island
            continue
        votes: dict[object, list[int]] = {}
        for i in group:
            if headers[i].votes:
                votes.setdefault(_base(headers[i]), []).append(i)
        source = max(votes.values(), key=lambda g: (len(g), -g[0]))[0] if votes else group[0]
        furthest = max(_steps(headers[i]) for i in group)
        for i in group:
            if _base(headers[i]) == _base(headers[source]):
                agree.append(i)
            else:
                repairs[i] = source
            if _steps(headers[i]) < furthest:
                ages[i] = furthest - _steps(headers[i])
    return sorted(agree), repairs, ages


def _base(header: RoundHeader) -> int | None:
    """The checksum of the island's base of the round's stage (its state summary's anchors field)."""
    return None if header.state is None else header.state.anchors


def _steps(header: RoundHeader) -> int:
    """The island's outer step count of the round's fragment."""
    return 0 if header.state is None else header.state.fragment_steps


def spread(headers: Sequence[RoundHeader], anchor_sq: float) -> float:
    """The largest distance between two present islands' global models (their headers' sketches),
    relative to ``sqrt(anchor_sq)`` (this island's model's norm); 0 with fewer than two sketches."""
    sketches = [torch.tensor(h.sketch, dtype=torch.float64) for h in headers if not h.absent and h.sketch]
    if len(sketches) < 2 or anchor_sq <= 0:
        return 0.0
    far = max(float((a - b).norm()) for k, a in enumerate(sketches) for b in sketches[k + 1:])
    return far / math.sqrt(anchor_sq)


def proposal(optimizer: outer.OuterSGD, anchors: Sequence[Tensor],
             deltas: Sequence[Tensor]) -> tuple[outer.OuterSGD, list[Tensor]]:
    """This island's outer step on its own pseudo-gradients, taken on copies: the stepped optimizer
    (its momentum) and the proposal; the state itself changes only when the round counts."""
    stepped = copy.copy(optimizer)
    stepped.buffers = [None if b is None else b.clone() for b in optimizer.buffers]
    params = [a.clone() for a in anchors]
    stepped.step(params, deltas)
    return stepped, params


class MixExchange:
    """The leader's side of one butterfly round, :meth:`run` once per chunk (as
    :class:`~lightning_islands.engine.exchange.ChunkExchange` is for the all-reduce).

    Args:
        codec: the wire format.
        link: the other islands.
        island: this island's index.
        group: the islands of its group present in the round, in island order.
        members: those of them whose proposals are mixed (this island may be left out: it then
            sends nothing and adopts the mix).
        weights: every island's merge weight, in island order.
        delta_sq: this island's pseudo-gradient's squared norm (metrics).
        keep_residual: whether to return what the codec dropped (error feedback).
    """

    def __init__(self, codec: Codec, link: Link, island: int, group: Sequence[int], members: Sequence[int],
                 weights: Sequence[float], delta_sq: float, keep_residual: bool,
                 experts: tuple[CanonicalLayout, dict[str, list[Tensor]]] | None = None) -> None:
        self.codec, self.link, self.island = codec, link, island
        self.experts = experts
        self.peers = [i for i in group if i != island]
        self.members, self.weights = list(members), [float(weights[i]) for i in members]
        self.stats = RoundStats(len(self.members), delta_sq)
        self.keep_residual = keep_residual
        self.link_sums = dict.fromkeys(LINK_TOTALS, 0.0)
        self.spread_sq = dict.fromkeys(self.peers, 0.0)  # squared distance to each partner's proposal
        self.stage, self.anchor_sq, self.spread = 0, 0.0, 0.0  # for the metrics
        self.scratch = Buffers()

    def run(self, part: Tensor, start: int) -> tuple[Tensor, Tensor | None]:
        """Quantize this chunk of what the island sends (its proposal's distance from the base, plus
        the decayed residual), swap it with the group, mix the members' in island order. Returns the
        mixed distance from the base and, with error feedback, what quantization dropped: both in
        the scratch buffers, valid until the next chunk."""
        scratch, codec = self.scratch, self.codec
        m, dev = part.numel(), part.device
        residual = scratch.take("residual", m, device=dev) if self.keep_residual else None
        mine = self.island in self.members
        if mine:
            payload = codec.encode(part, out=scratch.take("payload", codec.nbytes(m), torch.uint8, dev),
                                   scratch=scratch)
            own = codec.decode(payload, out=scratch.take("own", m, device=dev), scratch=scratch)
            if residual is not None:
                torch.sub(part, own, out=residual)
        else:  # left out (repaired, or a non-finite pseudo-gradient): it adopts the group's mix
            payload, own = torch.empty(0, dtype=torch.uint8, device=dev), part
            if residual is not None:
                residual.zero_()
        # every island swaps every chunk, a lone one with nobody: the links' payload sequences stay in step
        got = self.link.swap_bytes(payload, self.peers, limit=codec.nbytes(m))
        moved = self.link.take_stats()
        for key in LINK_TOTALS:
            self.link_sums[key] += getattr(moved, key)
        decoded = [own if i == self.island else
                   codec.decode(got[i].to(dev), out=scratch.take(f"decoded{i}", m, device=dev), scratch=scratch)
                   for i in self.members]
        if not decoded:  # no island of the group can be mixed: each keeps its state (PendingMix.land)
            merged = torch.zeros_like(part)
        elif len(decoded) == 1:
            merged = torch.clone(decoded[0])
        else:
            merged = outer.merge(decoded, self.weights, out=scratch.take("merged", m, device=dev),
                                 scratch=scratch.take("term", m, device=dev))
            if self.experts is not None:
                merge_expert_values(merged, decoded, start, *self.experts)
        if mine:
            for i, d in zip(self.members, decoded):
                if i != self.island:
                    self.spread_sq[i] += _diff_sq(d, own)
        self.stats.add(part, own, payload.numel(), decoded, merged)
        return merged, residual

    def metrics(self, chunks: int, num_islands: int, error_feedback: bool) -> dict[str, float]:
        """The round's metrics, once every chunk moved (``chunks``): the all-reduce's, and the stage,
        the group's size, ``islands/partner_spread``: the largest distance between this island's
        proposal and a partner's before the mix, and ``islands/spread``: the largest distance between
        two islands' global models before the round (estimated from their sketches), each relative
        to the norm of this island's global model (:attr:`anchor_sq`)."""
        metrics = self.stats.metrics(error_feedback=error_feedback)
        anchor_sq, stage = self.anchor_sq, self.stage
        metrics.update({f"islands/{key}": value for key, value in self.link_sums.items()})
        spread = math.sqrt(max(self.spread_sq.values(), default=0.0))
        metrics.update({"islands/exchange_chunks": float(chunks), "islands/butterfly_stage": float(stage),
                        "islands/group_size": float(len(self.peers) + 1), "islands/mixed": float(len(self.members)),
                        "islands/partner_spread": spread / math.sqrt(anchor_sq) if anchor_sq > 0 else 0.0,
                        "islands/spread": self.spread,
                        "islands/islands_present": float(len(self.link.present)),
                        "islands/islands_left_out": float(len(self.peers) + 1 - len(self.members)),
                        "islands/cosine": self.stats.cosine()})
        return metrics

    def take(self, name: str, numel: int, device: torch.device) -> Tensor:
        """A chunk-sized fp32 scratch tensor (the gathered chunk), reused by every chunk."""
        return self.scratch.take(name, numel, device=device)

    def release(self) -> None:
        """Drop the scratch buffers (after the last chunk)."""
        self.scratch.clear()


@dataclass
class PendingMix:
    """One butterfly round of one rank, from :meth:`start` (the proposal) to :meth:`land`."""

    butterfly: Butterfly
    stage: int
    fragment: int
    stepped: outer.OuterSGD  # the island's outer optimizer after its own step (committed when it is mixed)
    anchor_sq: float = 0.0  # the squared norm of the island's global model of the fragment (the spread's scale)
    group: list[int] = field(default_factory=list)  # the group's islands present, in island order
    members: list[int] = field(default_factory=list)  # those mixed
    steps_after: int = 0  # the group's outer step count after the round (a late island's catches up)
    spread: float = 0.0  # the islands' spread before the round, estimated from their sketches
    repairs: dict[int, int] = field(default_factory=dict)  # each island whose base differs: its group's source

    @classmethod
    def start(cls, butterfly: Butterfly, state: OuterState, fragment: int, round_: int, fragments: int,
              deltas: Sequence[Tensor]) -> tuple[PendingMix, list[Tensor]]:
        """The island's own outer step (on copies) and what it sends: the proposal minus the stage's base."""
        stage = stage_of(butterfly, round_, fragments)
        idx = state.indices(fragment)
        stepped, params = proposal(state.optimizers[fragment], [state.anchors[i] for i in idx], deltas)
        base = [state.bases[stage][i] for i in idx]
        return cls(butterfly, stage, fragment, stepped), [p.sub_(b.to(p.device)) for p, b in zip(params, base)]

    def arrange(self, headers: Sequence[RoundHeader], plan: MergePlan, island: int) -> None:
        """The group and its members, from the headers alone (no collective: an overlapped round's
        thread calls it): the islands whose base differs from their group's source are repaired,
        and left out of the mix."""
        _, self.repairs, _ = agreement(self.butterfly, headers, self.stage)
        self.group = present_group(self.butterfly, headers, island, self.stage)
        self.members = [i for i in self.group if i in plan.members and i not in self.repairs]
        self.steps_after = max(_steps(headers[i]) for i in self.group) + 1
        self.spread = spread(headers, self.anchor_sq)

    def repair(self, engine: IslandEngineBase, headers: Sequence[RoundHeader], locals_: Sequence[Tensor]) -> int:
        """Every rank: the repairs :meth:`arrange` found (a collective of the island), once the round
        counted and before its mix lands (a repaired island was left out of the mix and adopts it;
        synchronous and overlapped rounds alike, so that their calls on the link stay in step).
        Returns how many islands were repaired."""
        if self.repairs:  # every island swaps (most with nobody), so that the sequences of swaps stay aligned
            from lightning_islands.engine import mix_repair  # it reads this module's PendingMix

            mix_repair.repair(engine, self, headers, self.repairs, locals_)
        return len(self.repairs)

    def exchange(self, codec: Codec, link: Link | None, island: int, plan: MergePlan, delta_sq: float,
                 keep_residual: bool, layout: CanonicalLayout) -> MixExchange:
        """The leader's exchange of the round (``layout``: the fragment's; with expert weighting each
        expert's rows mix by the tokens the group's members routed to it)."""
        assert link is not None, "the butterfly runs with other islands"
        names = (plan.headers[self.members[0]].experts or {}) if self.members else {}
        coefs = {name: outer.expert_coefficients([plan.headers[i].experts[name] for i in self.members])  # type: ignore
                 for name in names}
        exchange = MixExchange(codec, link, island, self.group, self.members, plan.weights, delta_sq, keep_residual,
                               (layout, coefs) if coefs else None)
        exchange.stage, exchange.anchor_sq, exchange.spread = self.stage, self.anchor_sq, self.spread
        return exchange

    def land(self, state: OuterState, mixed: Sequence[Tensor], island: int) -> outer.OuterSGD:
        """The group's new global state ``base + mixed`` becomes the island's anchors (and, when
        another unit of the group was there, the stage's base); a mixed island keeps its stepped
        outer momentum, a left-out one its old. Returns the fragment's optimizer."""
        idx, base = state.indices(self.fragment), state.bases[self.stage]
        if self.members:
            partnered = {self.butterfly.unit_of(i) for i in self.group} != {self.butterfly.unit_of(island)}
            for g, i in zip(mixed, idx):
                torch.add(base[i], g.to(base[i].device), out=state.anchors[i])
                if partnered:
                    base[i].copy_(state.anchors[i])
        if island in self.members:
            state.optimizers[self.fragment] = self.stepped
        # the round counts for every island of the group (a left-out one keeps its momentum, not the step)
        state.optimizers[self.fragment].steps = self.steps_after
        return state.optimizers[self.fragment]
