"""DiLoCo for one rank of one island: rendezvous, the round in two halves, and the start agreement.

:class:`IslandEngine` owns what a round needs: the settings, the outer state, the schedule, the
codec and the link. It never sees a LightningModule: the caller hands it this rank's local shards
(``locals_``, plain tensors in parameter order), the island's ranks (an
:class:`~lightning_islands.engine.group.IslandGroup`, through the layout) and, on the leader, a
:class:`~lightning_islands.engine.group.Link` to the other islands.

A round has two halves. :meth:`IslandEngine.start` takes the pseudo-gradient (plus the decayed
error-feedback residual), agrees on the round's headers, and moves the bytes: each chunk of the
canonical vector is gathered to the leader, encoded once, all-gathered over the link, decoded,
merged in island order and scattered back, so it returns the merged pseudo-gradient of this rank's
shards. :meth:`IslandEngine.finish` takes the outer step on the anchors and writes them into the
local shards. Synchronous training calls them back to back (:meth:`IslandEngine.run_round`).
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from lightning_islands.codecs import with_residual
from lightning_islands.engine import health, outer
from lightning_islands.engine.checkpoint import load_outer_state, save_outer_state
from lightning_islands.engine.exchange import LINK_TOTALS, ChunkExchange
from lightning_islands.engine.flight import InFlight
from lightning_islands.engine.fragments import split_fragments
from lightning_islands.engine.group import Link
from lightning_islands.engine.layout import CanonicalLayout
from lightning_islands.engine.schedule import Schedule
from lightning_islands.engine.settings import IslandSettings, compare_fingerprints
from lightning_islands.engine.state import OuterState
from lightning_islands.engine.stats import RoundStats, sum_sq
from lightning_islands.membership import LateForRound, RoundLost, RunEnded
from lightning_islands.transport import IslandAborted

T = TypeVar("T")
log = logging.getLogger(__name__)
# what a round's headers hold for an island that is not present in it
ABSENT = {"absent": True, "tokens": 0.0, "steps": 0, "step_seconds": 0.0, "experts": None, "stop": False,
          "norm": None, "state": None}
# errors of the leader that every rank re-raises as they are: the round is run again, or rejoined
_RETRIED = {cls.__name__: cls for cls in (RoundLost, LateForRound, RunEnded)}
# the shortest default grace window (a short round must not drop an island that pauses briefly)
GRACE_FLOOR_S = 10.0
# how many times a round is run again after losing an island before the run gives up
MAX_ATTEMPTS = 16


@dataclass
class PendingRound:
    """What :meth:`IslandEngine.start` hands to :meth:`IslandEngine.finish`."""

    headers: list[dict[str, Any]]
    tokens: float
    step_seconds: float
    started: float
    fragment: int = 0
    grads: list[Tensor] | None = None  # the merged pseudo-gradient of this rank's shards; None: no step
    metrics: dict[str, float] = field(default_factory=dict)
    flight: InFlight | None = None  # an overlapped round's background exchange, until it lands
    experts: dict[str, list[float]] | None = None  # the island's tokens per expert in this round
    repaired: int = 0  # islands whose global state differed and was replaced at this round
    inner_steps: int = 0  # the island's inner steps when the round started
    blocking: float = 0.0  # seconds the training thread spent on an overlapped round (start and land)

    @property
    def stop(self) -> bool:
        """Whether some island ends training with this round (so every island does)."""
        return any(h["stop"] for h in self.headers)


class IslandEngine:
    """The outer loop of DiLoCo on one rank of one island.

    Args:
        settings: the islands' settings.
        layout: the canonical layout of the model's parameters over this island's ranks.
        island: this island's index; ``num_islands``: how many take part.
        device: where the island computes (its local shards live there).
        exchange_device: where the leader encodes, decodes and merges a chunk.
    """

    def __init__(self, settings: IslandSettings, layout: CanonicalLayout, island: int, num_islands: int,
                 device: torch.device, exchange_device: torch.device) -> None:
        self.settings = settings
        self.layout = layout
        self.group = layout.group
        self.island, self.num_islands = island, num_islands
        self.device, self.exchange_device = device, exchange_device
        self.codec = settings.make_codec()
        fragments = split_fragments([e.name for e in layout.entries], [e.numel for e in layout.entries],
                                    settings.fragments, settings.fragment_layout)
        self.fragment_layouts = [layout] if len(fragments) == 1 else [layout.subset(f) for f in fragments]
        self.state = OuterState([settings.outer_optimizer() for _ in fragments], settings.outer_device,
                                fragments if len(fragments) > 1 else None)
        self.schedule = Schedule(settings, island)
        self.link: Link | None = None  # the leader's, once the islands have met
        self.round_tokens = 0  # this rank's tokens in the current round
        # the island's tokens (and tokens per expert) of each of the last F - 1 rounds: a fragment's merge
        # weights count what the island trained since that fragment last synced
        self.recent_rounds: list[dict[str, Any]] = []
        self.in_flight: PendingRound | None = None  # an overlapped round not landed yet
        self.totals: dict[str, float] = dict.fromkeys(LINK_TOTALS, 0.0)
        self.last_round_metrics: dict[str, float] = {}
        self.initial_state_broadcast: bool | None = None  # whether island 0's state had to be sent
        self.joining = False  # (re)joining: the next round replaces this island's global state
        self._step_seconds = 0.0  # the last round's seconds per inner step (the default grace window)
        self._state_exchanges = 0

    def grace_s(self) -> float:
        """How long a round waits for an island that shows no sign of life: ``grace_s``, else the
        expected length of a round (this island's last one), at least 10 s."""
        if self.settings.grace_s is not None:
            return float(self.settings.grace_s)
        return max(GRACE_FLOOR_S, self.schedule.steps_per_round * self._step_seconds)

    @property
    def is_leader(self) -> bool:
        """Whether this rank is its island's leader (the one that talks to other islands)."""
        return self.group.rank == 0

    def agree(self, leader_work: Callable[[], T]) -> T:
        """Run ``leader_work`` on the leader; every rank of the island gets its result, or its error.

        A failure on the leader is re-raised on every rank (and reported to the other islands),
        instead of leaving the island's other ranks waiting in a collective.
        """
        box: tuple[str, Any] = ("ok", None)
        if self.is_leader:
            try:
                box = ("ok", leader_work())
            except (RoundLost, LateForRound, RunEnded) as err:  # not a failure of the island: no abort
                box = (type(err).__name__, str(err))
            except Exception as err:  # noqa: BLE001 - forwarded to every rank below
                message = f"island {self.island}: {type(err).__name__}: {err}"
                if self.link is not None and not isinstance(err, IslandAborted):
                    with suppress(Exception):
                        self.link.abort(message)
                box = ("error", message)
        box = self.group.broadcast_object(box)
        if box[0] == "error":
            raise RuntimeError(box[1])
        if box[0] in _RETRIED:
            raise _RETRIED[box[0]](box[1])
        return box[1]

    # ------------------------------------------------------------------ rendezvous
    def meet(self, open_link: Callable[[], Link], fingerprint: dict[str, Any], rejoining: bool = False) -> None:
        """Leader: open the link, compare fingerprints through the coordinator, then open the lanes;
        every rank raises if any island differs. ``rejoining``: a restarted island compares with
        what the others published when they started, whether or not they resumed, and opens no
        lanes (the round that takes it back builds them)."""

        def leader() -> None:
            try:
                self.link = open_link()
            except Exception as err:
                raise RuntimeError(f"could not meet the other islands: {err}") from err
            prints = self.link.gather_objects("fingerprint", fingerprint)
            if rejoining:
                prints = [{k: v for k, v in p.items() if k != "resuming"} for p in prints]
            error = compare_fingerprints(prints)
            if error:
                raise RuntimeError(error)
            if not rejoining:
                self.link.open_lanes()

        self.agree(leader)

    @torch.no_grad()
    def adopt_initial_state(self, locals_: Sequence[Tensor], buffers: dict[str, Tensor]) -> None:
        """Every island takes island 0's parameters (into ``locals_``) and ``buffers``; the anchors
        are taken from them (fp32).

        Islands first compare a SHA-256 of their full fp32 parameters and buffers: islands built
        from the same seed, or all loaded from the same plain checkpoint, already agree bit for
        bit, and then nothing is sent (a full fp32 copy less across the slow link). Otherwise island
        0's state is sent. Call it again after loading a plain checkpoint.
        """
        if self.num_islands == 1:
            self.state.set_anchors(locals_)
            return
        mine = self.layout.gather_to_leader(locals_, self.device)
        if self.layout.has_copies:  # copies on several ranks (replicated under tensor parallel) may differ
            with torch.no_grad():  # every copy takes the one gathered
                self.layout.scatter_from_leader(mine, self.device, into=list(locals_))
        self._state_exchanges += 1  # each call its own key
        key = f"initial_state/{self._state_exchanges}"
        found = self.agree(lambda: self.link.gather_objects(key, state_digest(mine, buffers)))  # type: ignore
        self.initial_state_broadcast = len(set(found)) != 1
        if not self.initial_state_broadcast:
            self.state.set_anchors(locals_)
            return
        if self.island == 0:
            self.agree(lambda: self.link.broadcast_bytes(mine.cpu().view(torch.uint8), src=0))  # type: ignore
            self.state.set_anchors(locals_)
        else:
            box: dict[str, Tensor] = {}
            self.agree(lambda: box.update(flat=self.link.broadcast_bytes(None, src=0).view(torch.float32)))  # type: ignore
            shards = self.layout.scatter_from_leader(box.get("flat"), self.device)
            # Anchors from the fp32 values received, not from parameters that may hold fewer bits.
            shards = [s.to(loc.device) for s, loc in zip(shards, locals_)]
            for loc, s in zip(locals_, shards):
                loc.copy_(s)
            self.state.set_anchors(shards)
        self._share_buffers(buffers)

    def _share_buffers(self, buffers: dict[str, Tensor]) -> None:
        """Island 0 sends its buffers, the others load them (every island has the same module)."""
        if not buffers:
            return
        if self.island == 0:
            blob = io.BytesIO()
            torch.save({k: v.detach().cpu() for k, v in buffers.items()}, blob)
            payload = torch.frombuffer(bytearray(blob.getvalue()), dtype=torch.uint8)
            self.agree(lambda: self.link.broadcast_bytes(payload, src=0))  # type: ignore[union-attr]
            return
        data = self.agree(lambda: self.link.broadcast_bytes(None, src=0).numpy().tobytes())  # type: ignore
        received = torch.load(io.BytesIO(data), weights_only=True)
        for name, buf in buffers.items():
            if name in received:
                buf.copy_(received[name].to(buf.device))

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

    def agree_on_start(self, more: bool) -> list[int]:
        """The islands' start agreement (a collective of the island): every island's global state
        must be the same; returns the islands that have no training steps left (``more=False``)."""
        if self.num_islands == 1:
            return [] if more else [self.island]
        digest = self.global_state_digest()
        round_ = self.schedule.round

        def compare() -> list[int]:
            found = self.link.gather_objects(  # type: ignore[union-attr]
                "start", {"digest": digest, "round": round_, "more": more})
            if len({d["digest"] for d in found}) != 1:
                raise RuntimeError(
                    f"islands start from different global states (at rounds {[d['round'] for d in found]}); "
                    "resume every island from its checkpoint of the same step, or none")
            return [i for i, d in enumerate(found) if not d["more"]]

        return self.agree(compare)

    def continue_from(self, previous: IslandEngine) -> None:
        """Take over the rounds, outer state and link totals of an earlier engine of this island (a
        second fit with the same strategy); the anchors are taken anew from the parameters."""
        self.schedule = previous.schedule
        self.state.optimizers, self.state.residual = previous.state.optimizers, previous.state.residual
        self.recent_rounds = previous.recent_rounds
        self.totals, self.last_round_metrics = previous.totals, previous.last_round_metrics
        self._state_exchanges = previous._state_exchanges

    def settle_start(self, done: list[int]) -> tuple[bool, str | None, bool]:
        """Act on the start agreement (``done``: the islands without steps left). Returns whether
        to stop at once, and a message for the user (``None``: nothing to say) with whether it is
        a warning.

        Every island has steps: go on, also after the agreed end of an earlier run (a final
        checkpoint resumed with more steps). Some island has none: no round could complete (that
        island never joins one), so every island stops at once.
        """
        schedule = self.schedule
        if not done:
            if not schedule.stopping:
                return False, None, False
            schedule.stopping = False
            return False, f"islands: continuing after round {schedule.round}, where the previous run ended", False
        if schedule.stopping:
            return True, (f"islands: this checkpoint is the agreed end of a run (round {schedule.round}) and not "
                          "every island has steps left; stopping. Raise trainer.max_steps to train further."), False
        schedule.stopping = True  # the end of training must not start a round the others never join
        return True, (f"islands: island(s) {done} have no steps left (trainer.max_steps reached), so no round can "
                      f"complete; not every island has steps left, stopping at round {schedule.round}. Give every "
                      "island a max_steps above the step it resumes from."), True

    def fingerprint(self, resuming: bool) -> dict[str, Any]:
        """What must be equal on every island (:meth:`IslandSettings.fingerprint`) for this one."""
        return self.settings.fingerprint(self.layout, self.num_islands, resuming, self.device)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_meta(self, resuming: bool) -> dict[str, Any]:
        """The counters a checkpoint keeps beside the outer state, its ``islands`` entry (a collective
        of the island: the round's tokens are summed over its ranks)."""
        state = self.state.state_dict()
        return {**self.schedule.state_dict(), "round_tokens": self.group.sum([self.round_tokens])[0],
                "totals": dict(self.totals), "outer_steps": state["outer_steps"],
                "recent_rounds": list(self.recent_rounds),
                "has_momentum": state["momentum"] is not None, "has_residual": state["residual"] is not None,
                "island": self.island, "num_islands": self.num_islands, "fingerprint": self.fingerprint(resuming)}

    def save_checkpoint(self, path: Path, params: Sequence[Tensor]) -> None:
        """Save this rank's outer state into the checkpoint folder ``path``, placed like ``params``
        (a collective of the island)."""
        save_outer_state(path, self.state.state_dict(), params, self.layout)

    def load_checkpoint(self, path: Path, meta: dict[str, Any], params: Sequence[Tensor]) -> None:
        """Restore the outer state from the checkpoint folder ``path`` and the counters ``meta`` of
        :meth:`checkpoint_meta` (a collective of the island). A checkpoint of another
        island is refused with the fix."""
        if meta["island"] != self.island or meta.get("num_islands", self.num_islands) != self.num_islands:
            raise ValueError(
                f"{path} was saved by island {meta['island']} of {meta.get('num_islands')}, but this is island "
                f"{self.island} of {self.num_islands}; give each island its own checkpoint (resume=[...])")
        use_residual = bool(meta.get("has_residual")) and self.settings.use_error_feedback
        keys = ["anchor"] + ["momentum"] * bool(meta["has_momentum"]) + ["residual"] * use_residual
        loaded = load_outer_state(path, keys, params, self.layout, self.state.anchors)
        self.state.load_state_dict({"anchor": loaded["anchor"], "momentum": loaded.get("momentum"),
                                    "residual": loaded.get("residual"), "outer_steps": meta["outer_steps"]})
        self.schedule.load_state_dict(meta)
        self.round_tokens = int(meta["round_tokens"]) if self.is_leader else 0
        self.recent_rounds = list(meta.get("recent_rounds", []))
        self.totals = dict(meta["totals"])

    # ------------------------------------------------------------------ the round
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

    def run_round(self, locals_: Sequence[Tensor], experts: dict[str, list[float]] | None = None,
                  stop: bool = False, started: float | None = None) -> tuple[dict[str, float], bool]:
        """Both halves back to back: returns the round's metrics (empty when no island stepped) and
        whether the islands agreed to stop after this round."""
        pending = self.start(locals_, experts, stop, started)
        return self.finish(pending, locals_), pending.stop

    @torch.no_grad()
    def start(self, locals_: Sequence[Tensor], experts: dict[str, list[float]] | None = None,
              stop: bool = False, started: float | None = None, background: bool = False) -> PendingRound:
        """The first half (every rank of every island): pseudo-gradient, headers, exchange, merge.

        ``locals_``: this rank's local shards (of every parameter; the round takes its fragment's);
        ``experts``: this island's tokens per expert of each expert parameter (expert weighting;
        summed over the island already); ``stop``: this island ends training with this round (the
        others learn it through the headers); ``started``: when the round began
        (``time.perf_counter()``; default now), if gathering its inputs took time.

        ``background``: overlap the round with the next inner steps. Only the fragment's snapshot is
        gathered to the leader here; the headers and the exchange run in a background thread of the
        leader, and :meth:`land` waits for them; the next round is timed from here. At most one
        round is in flight.
        """
        if self.in_flight is not None:
            raise RuntimeError("a round is still in flight: land it (IslandEngine.land) before starting the next")
        t_start = time.perf_counter() if started is None else started
        s, state = self.settings, self.state
        fragment = self.schedule.fragment
        idx, layout = state.indices(fragment), self.fragment_layouts[fragment]
        deltas = [outer.pseudo_gradient(state.anchors[i].to(locals_[i].device), locals_[i]) for i in idx]
        # the pseudo-gradient's squared norm (a plain, replicated tensor counts once: on rank 0)
        own_sq = sum_sq([d for j, d in enumerate(deltas) if layout.owns(j)])
        sent = deltas
        if s.use_error_feedback:  # each rank adds its shards of (a share of) what the last rounds dropped
            if state.residual is None:
                state.residual = [torch.zeros_like(a) for a in state.anchors]
            else:
                sent = [with_residual(d, state.residual[i].to(d.device), s.error_feedback_decay)
                        for d, i in zip(deltas, idx)]
        delta_sq, tokens = self.group.sum([own_sq, float(self.round_tokens)])
        step_seconds = self.schedule.step_seconds(t_start)
        self._step_seconds = step_seconds
        pending = PendingRound([], tokens, step_seconds, t_start, fragment, inner_steps=self.schedule.inner_steps,
                               experts=experts)
        window_tokens, window_experts = self._since_last_sync(pending, layout)
        header = {"round": self.schedule.round, "tokens": window_tokens, "steps": self.schedule.round_steps,
                  "step_seconds": step_seconds, "experts": window_experts, "stop": stop,
                  "norm": math.sqrt(delta_sq) if math.isfinite(delta_sq) else None,
                  "state": self.state_summary(fragment) if self.num_islands > 1 else None}
        if self.joining:
            header["joining"] = True  # its state is whatever it restarted with: it is repaired, not merged
        if background:
            return self._start_background(pending, sent, delta_sq, header)
        return self._attempts(header["round"], lambda: self._attempt(pending, sent, delta_sq, header, locals_),
                              lambda why: self._left_behind(pending, why, 0), lambda: self._ended(pending))

    def _attempts(self, round_: int, attempt: Callable[[], T], late: Callable[[str], T], ended: Callable[[], T]) -> T:
        """Run ``attempt`` until one counts: again after it lost an island (:class:`RoundLost`);
        ``late(why)`` when the round went on without this island, ``ended()`` when the run ended."""
        for k in range(MAX_ATTEMPTS):
            try:
                return attempt()
            except RoundLost as err:
                if self.is_leader:
                    log.warning("islands: %s (attempt %d)", err, k + 1)
            except LateForRound as err:
                return late(str(err))
            except RunEnded:
                return ended()
        raise IslandAborted(f"round {round_} failed {MAX_ATTEMPTS} times in a row; see the warnings")

    def _attempt(self, pending: PendingRound, sent: Sequence[Tensor], delta_sq: float, header: dict[str, Any],
                 locals_: Sequence[Tensor]) -> PendingRound:
        """One attempt of a synchronous round: headers, repair, exchange, and the agreement that it counted."""
        coefs: dict[str, list[Tensor]] = {}  # the leader's per-expert merge coefficients of this round
        pending.headers = self.agree(lambda: self._meet_round(header, coefs))
        if any(h["steps"] > 0 for h in pending.headers):
            pending.grads, pending.metrics = self._exchange(sent, delta_sq, pending.headers, coefs, pending.fragment)
            pending.metrics.update(self._expert_gap_metrics(pending.headers))
        # else every island ended exactly at a round boundary: this exchange only agreed to stop, and an
        # outer step on zero pseudo-gradients would still move the anchor by the momentum
        self.agree(lambda: self._settle(pending.stop))
        if pending.stop:
            self.schedule.stopping = True
        self.joining = False
        # after the exchange, as an overlapped round does (a joiner's round and the others' may differ in kind)
        pending.repaired = self._repair_counted(pending.headers, locals_)
        return pending

    def _settle(self, stop: bool) -> None:
        """Leader: wait until every member finished the round's exchange (it counts); a last round
        is recorded, so that an island still rejoining stops too."""
        if self.link is None:
            return
        self.link.settle_round()
        if stop:
            self.link.end_run(self.schedule.round)

    def _left_behind(self, pending: PendingRound, why: str, steps_since: int) -> PendingRound:
        """The round went on without this island (it came too late): it takes no outer step now and
        joins the next round, where the others' global state replaces its own. ``steps_since``:
        inner steps taken since the round's sync point (they count for the next round)."""
        if self.is_leader:
            log.warning("islands: %s; island %d rejoins at the next round", why, self.island)
        self.joining = True
        self.schedule.skip(steps_since)
        pending.headers, pending.grads = [], None
        return pending

    def _ended(self, pending: PendingRound) -> PendingRound:
        """The others ended training while this island was getting back in: it stops too."""
        if self.is_leader:
            log.warning("islands: the other islands ended training; island %d stops at round %d", self.island,
                        self.schedule.round)
        self.schedule.stopping = True
        pending.headers, pending.grads = [dict(ABSENT, stop=True)], None
        return pending

    @torch.no_grad()
    def rejoin(self, locals_: Sequence[Tensor]) -> tuple[dict[str, float], bool]:
        """A restarted island (every rank): ask the live islands to take it back, then run the round
        they take it into as a joiner: it receives their global parameters, outer state and round
        number, takes that round's outer step with them and ends it bit-identical to them. Returns
        the round's metrics and whether the islands agreed to stop after it."""
        self.state.set_anchors(locals_)
        assert self.link is not None or not self.is_leader
        try:
            round_ = self.agree(lambda: self.link.rejoin(self.settings.max_wait_s))  # type: ignore[union-attr]
        except RunEnded:
            self.schedule.stopping = True
            return {}, True
        self.schedule.rejoin(round_)
        self.joining = True
        if self.is_leader:
            log.warning("islands: island %d rejoins the run at round %d", self.island, round_)
        # synchronous: its link sees the same calls as the others' round, overlapped or not
        return self.run_round(locals_)

    def _since_last_sync(self, pending: PendingRound, layout: CanonicalLayout
                         ) -> tuple[float, dict[str, list[float]] | None]:
        """The island's tokens, and tokens per expert of the fragment's expert parameters, since the
        fragment last synced: this round and the F - 1 before it (the merge weights)."""
        rounds = [*self.recent_rounds, {"tokens": pending.tokens, "experts": pending.experts}]
        tokens = sum(float(r["tokens"]) for r in rounds)
        if pending.experts is None:
            return tokens, None
        names = {e.name for e in layout.entries}
        experts = {}
        for name, counts in pending.experts.items():
            if name in names:
                earlier = [r["experts"][name] for r in rounds[:-1] if r.get("experts") and name in r["experts"]]
                experts[name] = [sum(c) for c in zip(counts, *earlier)]
        return tokens, experts

    def _start_background(self, pending: PendingRound, sent: Sequence[Tensor], delta_sq: float,
                          header: dict[str, Any]) -> PendingRound:
        """Gather the fragment's vector to the leader (an island collective, now) and start its
        exchange in the leader's background thread; the round is in flight until it lands."""
        layout = self.fragment_layouts[pending.fragment]
        flat = layout.gather_to_leader(sent, self.device, self.exchange_device)
        if self.is_leader:
            assert flat is not None
            keep_residual = self.state.residual is not None
            pending.flight = InFlight(lambda: self._exchange_in_background(flat, delta_sq, header, pending.fragment,
                                                                           keep_residual),
                                      name=f"island{self.island}-round{self.schedule.round}")
        self.in_flight = pending
        pending.blocking = time.perf_counter() - pending.started
        self.round_tokens = 0  # the steps taken while it flies count for the next round
        self.schedule.round_steps = 0
        self.schedule.restart_clock()
        return pending

    def landing_due(self) -> bool:
        """Whether the round in flight has flown its ``overlap_steps`` inner steps."""
        flying = self.in_flight
        return flying is not None and self.schedule.inner_steps - flying.inner_steps >= self.settings.overlap_steps

    def _exchange_in_background(self, flat: Tensor, delta_sq: float, header: dict[str, Any], fragment: int,
                                keep_residual: bool) -> dict[str, Any]:
        """The leader's background work of an overlapped round: headers, then every chunk; a round
        that loses an island runs again without it."""
        return self._attempts(header["round"],
                              lambda: self._background_attempt(flat, delta_sq, header, fragment, keep_residual),
                              lambda why: {"headers": [], "late": why},
                              lambda: {"headers": [dict(ABSENT, stop=True)], "ended": True})

    def _background_attempt(self, flat: Tensor, delta_sq: float, header: dict[str, Any], fragment: int,
                            keep_residual: bool) -> dict[str, Any]:
        coefs: dict[str, list[Tensor]] = {}
        headers = self._meet_round(header, coefs)
        stop = any(h["stop"] for h in headers)
        if not any(h["steps"] > 0 for h in headers):
            self._settle(stop)
            return {"headers": headers}
        layout = self.fragment_layouts[fragment]
        members = self._members(headers)
        stats = RoundStats(len(members), delta_sq)
        exchange = ChunkExchange(self.codec, self.link, self.island, self._weights(headers), coefs, layout, stats,
                                 keep_residual=keep_residual, members=members)
        merged = torch.empty_like(flat)
        residual = torch.empty_like(flat) if keep_residual else None
        chunks = outer.chunk_bounds(layout.numel, self.settings.exchange_chunk)
        for start, stop_at in chunks:
            got, dropped = exchange.run(flat[start:stop_at], start)
            merged[start:stop_at].copy_(got)
            if residual is not None:
                residual[start:stop_at].copy_(dropped)
        exchange.release()
        self._settle(stop)
        metrics = self._exchange_metrics(stats, exchange, len(chunks))
        metrics.update(self._expert_gap_metrics(headers))
        # this thread's waits for the other islands were not idle time (training went on): the round's
        # waiting is what landing it blocks for (counted there)
        in_flight = exchange.link_sums["seconds_waiting"]
        self.totals["seconds_waiting"] -= in_flight
        metrics["islands/seconds_waiting_in_flight"] = metrics.pop("islands/seconds_waiting", in_flight)
        return {"headers": headers, "merged": merged, "residual": residual, "metrics": metrics}

    @torch.no_grad()
    def land(self, locals_: Sequence[Tensor]) -> tuple[dict[str, float], bool]:
        """Land the round in flight, if any (every rank): wait for its exchange, take its outer step
        and blend it into ``locals_`` (``overlap_alpha``). Returns its metrics (empty when there was
        none, or no island stepped) and whether the islands agreed to stop after it."""
        pending = self.in_flight
        if pending is None:
            return {}, False
        return self.finish(pending, locals_), pending.stop

    def _complete(self, pending: PendingRound) -> None:
        """Wait for an overlapped round's exchange (leader) and hand its results to every rank."""
        t0 = time.perf_counter()
        flight, box = pending.flight, {}
        self.in_flight, pending.flight = None, None
        pending.headers = self.agree(lambda: (box.update(flight.join()), box["headers"])[1])  # type: ignore[union-attr]
        late, ended = self.agree(lambda: (box.get("late"), box.get("ended")))
        if late:
            self._left_behind(pending, late, self.schedule.inner_steps - pending.inner_steps)
            return
        if ended:
            self._ended(pending)
            return
        if pending.stop:
            self.schedule.stopping = True
        self.joining = False
        waited = time.perf_counter() - t0
        if not any(h["steps"] > 0 for h in pending.headers):
            return
        layout, idx = self.fragment_layouts[pending.fragment], self.state.indices(pending.fragment)
        pending.grads = [g.to(self.state.anchors[i].device)
                         for g, i in zip(layout.scatter_from_leader(box.get("merged"), self.device), idx)]
        if self.state.residual is not None:
            layout.scatter_from_leader(box.get("residual"), self.device,
                                       into=[self.state.residual[i] for i in idx])
        pending.metrics = dict(box.get("metrics", {}))
        if self.is_leader:
            pending.metrics["islands/seconds_waiting"] = waited
            pending.metrics["islands/seconds_flight_cpu"] = flight.cpu_seconds  # type: ignore[union-attr]
            self.totals["seconds_waiting"] += waited

    @torch.no_grad()
    def finish(self, pending: PendingRound, locals_: Sequence[Tensor]) -> dict[str, float]:
        """The second half: the outer step on the fragment's anchors, written into ``locals_``
        (an overlapped round blends them with the local parameters, ``overlap_alpha``); returns the
        round's metrics (empty when no island stepped, and then nothing changes)."""
        overlapped = pending is self.in_flight
        landing = time.perf_counter()
        if overlapped:
            self._complete(pending)
            pending.repaired = self._repair_counted(pending.headers, locals_)
        if pending.grads is None:
            return {}
        idx = self.state.indices(pending.fragment)
        opt = self.state.step(pending.fragment, pending.grads)
        pending.grads = None
        metrics = dict(pending.metrics)
        metrics.update({"islands/outer_lr": opt.lr_at(opt.steps), "islands/outer_momentum": opt.momentum_at(opt.steps)})
        self.state.write_to(locals_, idx, self.settings.overlap_alpha if overlapped else 0.0)
        self.schedule.advance(pending.tokens, pending.headers,
                              self.schedule.inner_steps - pending.inner_steps if overlapped else 0)
        keep = self.settings.fragments - 1
        self.recent_rounds = [*self.recent_rounds, {"tokens": pending.tokens, "experts": pending.experts}][-keep:] \
            if keep else []
        if not overlapped:
            self.round_tokens = 0
        sched = self.schedule
        metrics.update({"islands/round": float(sched.round), "islands/fragment": float(pending.fragment),
                        "islands/islands_repaired": float(pending.repaired),
                        "islands/inner_steps": float(sched.inner_steps), "islands/round_tokens": pending.tokens,
                        "islands/step_seconds": pending.step_seconds,
                        "islands/steps_per_round": float(sched.steps_per_round),
                        "islands/seconds_outer_step": time.perf_counter() - pending.started})
        if overlapped:  # the training thread's share of the round, waiting included
            metrics["islands/seconds_blocking"] = pending.blocking + time.perf_counter() - landing
        metrics.update({f"islands/total_{k}": v for k, v in self.totals.items()})
        self.last_round_metrics = metrics
        return metrics

    def _members(self, headers: Sequence[dict[str, Any]]) -> list[int]:
        """The islands merged this round: those that hold the majority's global state (see
        :meth:`_repair`) with a sound pseudo-gradient (:func:`outer.merge_members` of the norms)."""
        agree = set(health.majority(headers))
        voting = [h.get("norm") if i in agree else None for i, h in enumerate(headers)]
        return outer.merge_members(voting, self.settings.exclude_norm_ratio)

    # ------------------------------------------------------------------ the state check
    def state_summary(self, fragment: int) -> dict[str, Any]:
        """What every island's global state of ``fragment`` must agree on before a round
        (:func:`health.state_summary`; a collective of the island)."""
        return health.state_summary(self, fragment)

    def _repair_counted(self, headers: Sequence[dict[str, Any]], locals_: Sequence[Tensor]) -> int:
        """:meth:`_repair` once the round counted: a peer lost meanwhile leaves a drifted island as
        it was (it is repaired at its next round, not voting until then)."""
        try:
            return self._repair(headers, locals_)
        except RoundLost as err:
            if self.is_leader:
                log.warning("islands: %s", err)
            self.joining = self.joining or self.island not in health.majority(headers)
            return 0

    def _repair(self, headers: Sequence[dict[str, Any]], locals_: Sequence[Tensor]) -> int:
        """Replace a drifted island's global state (:func:`health.repair`; every rank)."""
        return health.repair(self, headers, locals_)

    def _weights(self, headers: Sequence[dict[str, Any]]) -> list[float]:
        """Each island's merge weight from the round headers: its tokens, or 1 with ``weighting="equal"``."""
        return [1.0 if self.settings.weighting == "equal" else float(h["tokens"]) for h in headers]

    def _meet_round(self, header: dict[str, Any], coefs: dict[str, list[Tensor]]) -> list[dict[str, Any]]:
        """Leader only: every island's round header, in island order; fills ``coefs`` with the
        per-expert merge coefficients (expert weighting)."""
        headers = [header]
        if self.link is not None:
            t0 = time.perf_counter()
            headers = [ABSENT if h is None else h for h in self.link.meet_round(self.schedule.round, header)]
            self.link.add_wait(time.perf_counter() - t0)
            for change in self.link.membership_changes():
                log.warning("islands: island %d sees membership change: %s", self.island, change)
        members = self._members(headers)
        left_out = [i for i, h in enumerate(headers) if i not in members and not h.get("absent")
                    and not h.get("joining")]
        if not members and not health.majority(headers):
            raise RuntimeError(f"round {self.schedule.round}: every island present is rejoining, so none holds the "
                               "global state; restart the run from the islands' last checkpoints (resume=...)")
        if not members:
            raise RuntimeError(f"round {self.schedule.round}: every island's pseudo-gradient is non-finite (NaN or "
                               "inf): training diverged; resume from an earlier checkpoint with a lower learning rate")
        if left_out:
            norms = [h.get("norm") for h in headers]
            log.warning("islands: round %d merges without island(s) %s: pseudo-gradient norms %s (non-finite, or more "
                        "than exclude_norm_ratio=%s times the median); they adopt the merged result",
                        self.schedule.round, left_out, norms, self.settings.exclude_norm_ratio)
        by_name = {e.name: e for e in self.layout.entries}
        for name in headers[members[0]]["experts"] or {}:  # None without expert weighting
            coefs[name] = outer.expert_coefficients([headers[i]["experts"][name] for i in members])
            if by_name[name].shape[0] != coefs[name][0].numel():
                raise ValueError(f"{name} has {by_name[name].shape[0]} rows but {coefs[name][0].numel()} expert counts")
        return headers

    def _expert_gap_metrics(self, headers: Sequence[dict[str, Any]]) -> dict[str, float]:
        """With expert weighting: how far the per-expert coefficients were from the islands' merge
        weights this round (largest, and token-weighted mean over experts, averaged over the expert
        parameters); nothing without it."""
        members = self._members(headers)
        names = list(headers[members[0]]["experts"] or {}) if members else []
        if not names:
            return {}
        all_weights = self._weights(headers)
        weights = [all_weights[i] for i in members]
        gaps = [outer.expert_share_gap([headers[i]["experts"][n] for i in members], weights) for n in names]
        return {"islands/expert_share_gap_max": max(g[0] for g in gaps),
                "islands/expert_share_gap_mean": sum(g[1] for g in gaps) / len(gaps)}

    def _exchange(self, sent: Sequence[Tensor], delta_sq: float, headers: Sequence[dict[str, Any]],
                  coefs: dict[str, list[Tensor]], fragment: int) -> tuple[list[Tensor], dict[str, float]]:
        """Every rank: the merged pseudo-gradient's part for this rank's shards of ``fragment`` (the
        outer step's gradients), one chunk of the fragment's flat vector at a time, from this rank's
        shards of what the island sends (``sent``: the pseudo-gradient plus the decayed
        error-feedback residual); the new residual goes back to the ranks the same way. The round's
        metrics on the leader."""
        layout, state, idx = self.fragment_layouts[fragment], self.state, self.state.indices(fragment)
        anchors = [state.anchors[i] for i in idx]
        residual = [state.residual[i] for i in idx] if state.residual is not None else None
        members = self._members(headers)
        stats = RoundStats(len(members), delta_sq)
        chunks = outer.chunk_bounds(layout.numel, self.settings.exchange_chunk)
        exchange = ChunkExchange(self.codec, self.link, self.island, self._weights(headers), coefs, layout, stats,
                                 keep_residual=residual is not None, members=members) if self.is_leader else None
        # one chunk: the scatter's own buffer becomes the gradients; several: each fills its part
        into = None if len(chunks) == 1 else [torch.zeros_like(a) for a in anchors]
        got: list[Tensor] = []
        for start, stop in chunks:
            part_buf = exchange.take("part", stop - start, self.exchange_device) if exchange else None
            part = layout.gather_to_leader(sent, self.device, self.exchange_device, start, stop, into=part_buf)
            del part_buf  # the same tensor as ``part`` on the leader
            box: dict[str, Tensor | None] = {}

            def leader_chunk(part: Tensor | None = part, start: int = start,
                             box: dict[str, Tensor | None] = box) -> None:
                assert part is not None and exchange is not None
                box["merged"], box["residual"] = exchange.run(part, start)

            self.agree(leader_chunk)
            del part, leader_chunk  # the next chunk reuses the leader's buffers
            if exchange is not None and stop == chunks[-1][1]:
                exchange.release()  # nothing left to reuse: the scatters get their room (merged and residual stay)
            got = layout.scatter_from_leader(box.pop("merged", None), self.device, start, stop, into=into)
            if residual is not None:
                layout.scatter_from_leader(box.pop("residual", None), self.device, start, stop, into=residual)
        grads = [g.to(a.device) for g, a in zip(got, anchors)]
        if exchange is None:
            return grads, {}
        return grads, self._exchange_metrics(stats, exchange, len(chunks))

    def _exchange_metrics(self, stats: RoundStats, exchange: ChunkExchange, chunks: int) -> dict[str, float]:
        """The leader's metrics of a round's exchange; adds its link totals to the run's."""
        metrics = stats.metrics(error_feedback=self.settings.use_error_feedback)
        metrics["islands/exchange_chunks"] = float(chunks)
        metrics["islands/islands_left_out"] = float(self.num_islands - len(exchange.members))
        metrics["islands/islands_present"] = float(len(self.link.present) if self.link is not None else 1)
        if self.link is not None:
            for key, value in exchange.link_sums.items():
                self.totals[key] += value
            metrics.update({f"islands/{key}": value for key, value in exchange.link_sums.items()})
            metrics["islands/cosine"] = stats.cosine()
        return metrics


def state_digest(flat: Tensor | None, buffers: dict[str, Tensor]) -> str:
    """SHA-256 of the full fp32 parameters and of every buffer (name, dtype, shape, bytes)."""
    assert flat is not None, "the leader holds the gathered parameters"
    h = hashlib.sha256(flat.cpu().numpy())
    for name, buf in buffers.items():
        h.update(f"{name}:{buf.dtype}:{tuple(buf.shape)}".encode())
        h.update(buf.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()
