"""The islands' settings as one validated object, and the fingerprint every island must share."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_islands.codecs import Codec, check_decay, default_error_feedback, make_codec
from lightning_islands.engine import floatenv, outer
from lightning_islands.engine.fragments import LAYOUTS
from lightning_islands.engine.layout import CanonicalLayout


def sync_warmup_list(value: Any) -> list[int]:
    """``sync_warmup`` as a list of positive ints, or a ValueError naming the expected form."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in value):
        raise ValueError(f"sync_warmup must be a list of H values (ints >= 1), one per early round, e.g. "
                         f"[10, 20, 40] (Hydra: islands.sync_warmup=[10,20,40]); got {value!r}")
    return [int(h) for h in value]


@dataclass
class IslandSettings:
    """How the islands train together. Validated on construction: a bad value raises a ValueError
    that names it and the fix. Everything that must agree between islands enters :meth:`fingerprint`.

    Args:
        sync_every: inner steps per round (H).
        sync_warmup: H of the first rounds, one entry per round, before ``sync_every`` applies
            (e.g. ``[10, 20, 40]``: sync often while the islands' models still diverge quickly, then
            rarely). An island with a fixed ``steps_per_round`` scales it by ``H_round / sync_every``.
        outer_lr, outer_momentum, nesterov: the outer SGD (lr 1, momentum 0: plain averaging).
        outer_lr_warmup, outer_momentum_warmup: rounds over which the outer learning rate and the
            outer momentum rise linearly to ``outer_lr`` and ``outer_momentum`` (round ``r`` of
            ``W`` uses ``r / W`` of each; 0: no warm-up). Each round logs the values it used.
        codec: wire format of pseudo-gradients (``fp32``, ``bf16``, ``fp8``, ``int8``, ``int4``,
            ``int2``, ``sign``, ``topk:F`` or ``topk:F+int4``); ``block_size`` its block.
        error_feedback: keep what quantization dropped for the next round; ``None`` = on for 4
            bits and below.
        error_feedback_decay: the share of the residual a round carries into the next: each round
            sends ``pseudo_gradient + decay * residual`` (1: all of it, plain error feedback; 0: none,
            the same as no error feedback). Below 1, what a codec held back for many rounds fades
            instead of arriving late, after the model has moved on. Needs error feedback on.
        steps_per_round: inner steps this island runs per round (defaults to ``sync_every``; a
            slower island may run fewer, the merge stays token-weighted).
        lanes: parallel TCP streams between islands.
        outer_device: where anchors, outer momentum, the error-feedback residual (each rank its
            shards of all three) and the leader's round exchange (encoding, decoding, merging) live:
            ``"cpu"`` offloads them. ``None``: all on the training device (on a GPU the exchange
            runs the codecs' Triton kernels there, a chunk at a time).
        weighting: ``"tokens"`` (merge weighted by tokens processed) or ``"equal"``.
        expert_weighting: weight each expert's pseudo-gradient by the tokens each island routed to
            that expert in the round (the module must implement ``island_token_counts()`` and
            ``reset_island_token_counts()``, as the provided MoE does).
        balance: ``"none"`` (every island runs ``steps_per_round``) or ``"time"``: after each round
            the islands agree on a wall-clock budget (H times the slowest island's step time) and
            each runs the inner steps that fit, so a fast island does not wait idle.
        max_rounds: stop training after this many outer rounds (needed with ``balance="time"``,
            where islands run different numbers of steps; set the Trainer's ``max_steps`` high).
        deadline_s: the longest one round may take on an island, from its first meeting of the
            round until the round counts, all attempts included (it replaces ``max_wait_s``,
            ``timeout_s`` and the fixed count of attempts); also the longest the start waits for an
            island that has not arrived, and the bound of a transfer nothing abandons first. Past
            it the run ends with an error that names the islands waited for. The island's own
            process group (its ranks other than the leader wait in it meanwhile) gets a timeout of
            at least twice this.
        fragments: split the parameters into this many fragments (whole blocks each, see
            :mod:`~lightning_islands.engine.fragments`); a round syncs one of them, every ``H / F``
            inner steps, in turn, so each fragment still syncs every H steps while the bytes of
            one sync, and the peak bandwidth, drop about F times (Streaming DiLoCo). H must be a
            multiple of F. Outer momentum and its step count, error feedback and payloads are
            per fragment.
        fragment_layout: ``"strided"`` (fragment f holds blocks f, f + F, ...) or ``"sequential"``.
        overlap_steps: tau; a round's exchange runs in the background while the island takes this
            many more inner steps, then the outer step lands (0: the island waits for it). At most
            one fragment is in flight: tau < H / F (a round that comes sooner, under time
            balancing, lands the one in flight first). The last round never overlaps.
        overlap_alpha: with overlap, the fragment's local parameters become
            ``global + alpha * (local - global)`` when its outer step lands: 0 takes the new global
            parameters (the steps taken meanwhile are dropped for the fragment), 1 keeps local.
        exclude_norm_ratio: a round merges without an island whose pseudo-gradient is not finite, or
            whose norm is more than this many times the (lower) median of the islands' norms (0 or
            ``None``: only non-finite ones); that island adopts the merged result.
        min_islands: the fewest islands a round may go on with. A round proceeds with the islands
            that arrive; one that died (silent for ``grace_s``) is left out, the others' merge
            weights renormalized over those present, and it is taken back when it restarts (it
            rejoins). Fewer islands alive than this ends the run with an error naming them.
        grace_s: how long an island may make no progress (no step, no validation batch, no
            checkpoint write, no wait or transfer within its deadline) before the others give it up
            and go on without it: a deadlocked, stopped or cut-off island alike. ``None``: the
            expected length of a round (this island's last one), at least 10 s. Until an island's
            first round counts (start-up, compilation) it counts as alive while its process runs.
            It must exceed the longest step.
        exchange_chunk_mib: the round exchanges the flat pseudo-gradient in chunks of this many MiB
            of fp32 (rounded down to whole codec blocks and packing groups), one after another:
            gathered to the leader, compensated, encoded, exchanged, decoded, merged and scattered
            back, so the leader holds one chunk's copies at a time (the error-feedback residual stays
            sharded like the anchors: each rank adds its shards before the gather and gets its
            shards of the new residual back). ``None`` or 0: one chunk. Top-k keeps its fraction
            of each chunk. Part of the fingerprint.
    """

    sync_every: int = 50
    sync_warmup: Sequence[int] | None = None
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    outer_lr_warmup: int = 0
    outer_momentum_warmup: int = 0
    codec: str = "fp32"
    block_size: int = 128
    error_feedback: bool | None = None
    error_feedback_decay: float = 1.0
    steps_per_round: int | None = None
    lanes: int = 2
    outer_device: str | None = None
    weighting: str = "tokens"
    expert_weighting: bool = False
    balance: str = "none"
    max_rounds: int | None = None
    deadline_s: float = 3600.0
    exchange_chunk_mib: float | None = 1024.0
    exclude_norm_ratio: float | None = 16.0
    fragments: int = 1
    fragment_layout: str = "strided"
    overlap_steps: int = 0
    overlap_alpha: float = 0.0
    min_islands: int = 1
    grace_s: float | None = None
    # derived, set by __post_init__
    use_error_feedback: bool = field(init=False)
    exchange_chunk: int | None = field(init=False)

    def __post_init__(self) -> None:
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0 (islands.deadline_s), got {self.deadline_s!r}")
        if isinstance(self.min_islands, bool) or not isinstance(self.min_islands, int) or self.min_islands < 1:
            raise ValueError(f"min_islands must be an int >= 1 (islands.min_islands), got {self.min_islands!r}")
        if self.grace_s is not None and not self.grace_s > 0:
            raise ValueError(f"grace_s must be > 0 or null (the expected round length), got {self.grace_s!r}")
        if self.sync_every < 1:
            raise ValueError(f"sync_every (H) must be >= 1, got {self.sync_every}")
        self.sync_warmup = sync_warmup_list(self.sync_warmup)
        if self.weighting not in ("tokens", "equal"):
            raise ValueError(f"weighting must be 'tokens' or 'equal', got {self.weighting!r}")
        if self.balance not in ("none", "time"):
            raise ValueError(f"balance must be 'none' or 'time', got {self.balance!r}")
        if self.max_rounds is not None and self.max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1 or None, got {self.max_rounds}")
        self._check_streaming()
        if self.lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {self.lanes}")
        self.outer_optimizer()  # validates the outer step's settings
        codec = self.make_codec()
        # whole blocks and packing groups per chunk: a chunked round sends the values one chunk would
        self.exchange_chunk = outer.exchange_chunk_numel(self.exchange_chunk_mib, codec.alignment)
        self.use_error_feedback = (default_error_feedback(self.codec) if self.error_feedback is None
                                   else bool(self.error_feedback))
        self.error_feedback_decay = check_decay(self.error_feedback_decay,
                                                "error_feedback_decay (islands.error_feedback_decay)")
        if self.error_feedback_decay != 1.0 and not self.use_error_feedback:
            why = "error_feedback=False" if self.error_feedback is False else f"the default for codec {self.codec!r}"
            raise ValueError(f"error_feedback_decay={self.error_feedback_decay} decays the error-feedback residual, "
                             f"but error feedback is off ({why}): set error_feedback=True "
                             "(islands.error_feedback=true) or leave the decay at 1")

    def _check_streaming(self) -> None:
        """Fragments and overlap: whole steps per fragment, one fragment in flight."""
        f, tau = self.fragments, self.overlap_steps
        if isinstance(f, bool) or not isinstance(f, int) or f < 1:
            raise ValueError(f"fragments must be an int >= 1 (islands.fragments), got {f!r}")
        if self.fragment_layout not in LAYOUTS:
            raise ValueError(f"fragment_layout must be one of {LAYOUTS} (islands.fragment_layout), "
                             f"got {self.fragment_layout!r}")
        uneven = [h for h in [*self.sync_warmup, self.sync_every] if h % f]
        if uneven:
            raise ValueError(f"with {f} fragments every H must be a multiple of {f} (a fragment syncs every H / F "
                             f"steps), but H={uneven[0]} is not; change islands.sync_every/sync_warmup or "
                             "islands.fragments")
        if isinstance(tau, bool) or not isinstance(tau, int) or not 0 <= tau < self.sync_every // f:
            raise ValueError(f"overlap_steps must be an int in [0, H / F = {self.sync_every // f}) (one fragment in "
                             f"flight at a time, landed before the next one's sync), got {tau!r}; lower "
                             "islands.overlap_steps or raise sync_every")
        if tau and min(self.sync_warmup, default=self.sync_every) // f <= tau:
            raise ValueError(f"overlap_steps={tau} exceeds H / F of a warm-up round (sync_warmup={self.sync_warmup}); "
                             "at most one fragment can be in flight")
        if self.exclude_norm_ratio is not None and not self.exclude_norm_ratio >= 0:
            raise ValueError(f"exclude_norm_ratio must be >= 0 (0 or null: off), got {self.exclude_norm_ratio}")
        if not 0.0 <= self.overlap_alpha <= 1.0:
            raise ValueError(f"overlap_alpha must be in [0, 1], got {self.overlap_alpha}")

    def make_codec(self) -> Codec:
        """The wire format of pseudo-gradients."""
        return make_codec(self.codec, block_size=self.block_size)

    def outer_optimizer(self) -> outer.OuterSGD:
        """A fresh outer optimizer (``outer_lr=1, outer_momentum=0``: plain averaging; Nesterov needs
        momentum, so it is off then)."""
        return outer.OuterSGD(lr=self.outer_lr, momentum=self.outer_momentum,
                              nesterov=self.nesterov and self.outer_momentum > 0,
                              lr_warmup=self.outer_lr_warmup, momentum_warmup=self.outer_momentum_warmup)

    def fingerprint(self, layout: CanonicalLayout, num_islands: int, resuming: bool,
                    training_device: torch.device | str) -> dict[str, Any]:
        """What must be equal on every island for the merge to make sense."""
        described = layout.describe()
        return {
            "parameters": hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16],
            "num_parameters": layout.numel,
            "num_tensors": len(layout.entries),
            "first_tensors": described[:3],
            "num_islands": num_islands,
            "sync_every": self.sync_every,
            "sync_warmup": self.sync_warmup,
            "outer": self.outer_optimizer().settings(),
            "codec": self.make_codec().spec(),
            "exchange_chunk": self.exchange_chunk,
            "weighting": self.weighting,
            "expert_weighting": self.expert_weighting,
            "balance": self.balance,
            "max_rounds": self.max_rounds,
            "fragments": [self.fragments, self.fragment_layout],
            "exclude_norm_ratio": self.exclude_norm_ratio,
            "overlap": [self.overlap_steps, self.overlap_alpha],
            "resuming": bool(resuming),
            # the link's: different lanes would wait for groups that never form; a member set or a
            # wait that islands judge differently would split the run
            "lanes": self.lanes,
            "min_islands": self.min_islands,
            "grace_s": self.grace_s,
            "deadline_s": self.deadline_s,
            # the merge and the outer step (on the host or the training device) give the same bits on
            # every island only where the float modes agree
            "subnormals": {"host": floatenv.describe("cpu"), "training_device": floatenv.describe(training_device)},
        }


def compare_fingerprints(prints: Sequence[dict[str, Any]]) -> str | None:
    """A message naming every field in which an island differs from island 0, or ``None``."""
    problems = []
    for i, fp in enumerate(prints[1:], start=1):
        for key in sorted(set(prints[0]) | set(fp)):
            a, b = prints[0].get(key), fp.get(key)
            if a != b:
                problems.append(f"island {i} has {key}={b!r} but island 0 has {key}={a!r}")
    if not problems:
        return None
    return ("islands disagree before the first step; make their model and island settings equal:\n  "
            + "\n  ".join(problems))
