"""The islands' settings as one validated object, and the fingerprint every island must share."""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, get_args, get_origin, get_type_hints

import numpy as np
import torch

from lightning_islands.codecs import Codec, check_decay, default_error_feedback, make_codec
from lightning_islands.engine import floatenv, outer
from lightning_islands.engine.fragments import LAYOUTS
from lightning_islands.engine.layout import CanonicalLayout

TOPOLOGIES = ("allreduce", "butterfly")
EXCHANGES = ("leader", "sliced")
# the shortest default grace window (a short round must not drop an island that pauses briefly)
GRACE_FLOOR_S = 10.0


def sync_warmup_list(value: Any) -> list[int]:
    """``sync_warmup`` as a list of positive ints, or a ValueError naming the expected form."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in value):
        raise ValueError(f"sync_warmup must be a list of H values (ints >= 1), one per early round, e.g. "
                         f"[10, 20, 40] (Hydra: islands.sync_warmup=[10,20,40]); got {value!r}")
    return [int(h) for h in value]


_KINDS = {int: "an int", float: "a number", bool: "true or false", str: "a string"}


def _conforms(value: Any, kind: Any) -> bool:
    if kind is bool:
        return isinstance(value, (bool, np.bool_))
    if kind is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
    if kind is float:
        return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    return isinstance(value, kind)


def check_types(obj: Any, prefix: str) -> None:
    """A ValueError naming the first field of the dataclass ``obj`` whose value is not of its declared
    type (ints stay ints: ``2.5`` for an int is refused, not cut to 2); ints given for floats become
    floats. Lists are checked by their own validators."""
    hints = get_type_hints(type(obj))
    for f in fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        args = [a for a in get_args(hint) if a is not type(None)]
        optional = type(None) in get_args(hint)
        kind = args[0] if optional and len(args) == 1 else hint
        if (value is None and optional) or get_origin(kind) is list or kind is Any:
            continue
        if kind in _KINDS and not _conforms(value, kind):
            null = " or null" if optional else ""
            raise ValueError(f"{f.name} must be {_KINDS[kind]}{null} ({prefix}.{f.name}), got {value!r}")
        if kind in (int, float, bool):  # numpy scalars and ints for floats become plain Python values
            setattr(obj, f.name, kind(value))


def setting(default: Any, help: str, *, factory: Callable[[], Any] | None = None) -> Any:
    """A settings field with its default and its help (the one place both live; the reference in
    docs/SETTINGS.md is generated from them)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class IslandSettings:
    """How the islands train together: every engine setting, its default, its check and its help
    (``IslandSettings.help(name)``; all of them in docs/SETTINGS.md). Validated on construction: a
    bad value raises a ValueError that names it and the fix. Everything that must agree between
    islands enters :meth:`fingerprint`.

    The defaults are DiLoCo's outer step (SGD with Nesterov momentum 0.9, lr 0.7) and the codec the
    default job measured best here: int4 with error feedback (docs/BENCHMARKS.md).
    """

    sync_every: int = setting(50, "Inner steps per round (H).")
    sync_warmup: list[int] | None = setting(
        None, "H of the first rounds, one entry per round, before `sync_every` applies (e.g. `[10, 20, 40]`: sync "
              "often while the islands' models still diverge quickly, then rarely). An island with a fixed "
              "`steps_per_round` scales it by `H_round / sync_every`.")
    outer_lr: float = setting(0.7, "Learning rate of the outer SGD (lr 1 with momentum 0: plain averaging).")
    outer_momentum: float = setting(0.9, "Momentum of the outer SGD (0: none).")
    nesterov: bool = setting(True, "Nesterov momentum in the outer SGD (needs `outer_momentum` > 0).")
    outer_lr_warmup: int = setting(
        0, "Rounds over which the outer learning rate rises linearly to `outer_lr` (round r of W uses r / W of it; "
           "0: no warm-up). Each round logs the value it used.")
    outer_momentum_warmup: int = setting(
        0, "Rounds over which the outer momentum rises linearly to `outer_momentum` (0: no warm-up).")
    codec: str = setting(
        "int4", "Wire format of pseudo-gradients: `fp32`, `bf16`, `fp8`, `int8`, `int4`, `int2`, `sign`, `topk:F` "
                "or `topk:F+int4` (F: the fraction kept).")
    block_size: int = setting(128, "Values per codec block (one scale each).")
    error_feedback: bool | None = setting(
        None, "Keep what quantization dropped and send it the next round; null: on for 4 bits and below.")
    error_feedback_decay: float = setting(
        1.0, "Share of the residual a round carries into the next: each round sends `pseudo_gradient + decay * "
             "residual` (1: plain error feedback; 0: none). Below 1, what a codec held back for many rounds fades "
             "instead of arriving after the model moved on. Needs error feedback on.")
    steps_per_round: int | None = setting(
        None, "Inner steps this island runs per round (null: `sync_every`); a slower island may run fewer, the "
              "merge stays token-weighted. Per island in the app: `members[i].steps_per_round`.")
    lanes: int = setting(2, "Parallel TCP streams between islands.")
    outer_device: str | None = setting(
        None, "Where anchors, outer momentum, the error-feedback residual (each rank its shards) and the leader's "
              "round exchange (encode, decode, merge) live: `cpu` offloads them; null: the training device (on a GPU "
              "the codecs' Triton kernels run there, a chunk at a time).")
    weighting: str = setting("tokens", "Merge weights: `tokens` (tokens processed in the round) or `equal`.")
    expert_weighting: bool = setting(
        False, "Weight each expert's pseudo-gradient by the tokens each island routed to it in the round (the "
               "module implements `island_token_counts()` and `reset_island_token_counts()`, as the provided MoE "
               "does).")
    balance: str = setting(
        "none", "`none` (every island runs `steps_per_round`) or `time`: after each round the islands agree on a "
                "wall-clock budget (H times the slowest island's step time) and each runs the inner steps that "
                "fit, so a fast island does not wait idle.")
    max_rounds: int | None = setting(
        None, "Stop after this many outer rounds (needed with `balance=time`, where islands run different numbers "
              "of steps; raise the Trainer's `max_steps`).")
    max_tokens: int | None = setting(
        None, "Stop after the round at which the tokens merged into the global model, summed over the islands, reach "
              "this many (a budget of the run's tokens, however the islands share them: a fast island trains more "
              "of them). The round that would pass it runs only the steps the budget has left. Needs `fragments=1` "
              "and no `overlap_steps`.")
    deadline_s: float = setting(
        3600.0, "The longest one round may take on an island, from its first meeting until the round counts, all "
                "attempts included; also the longest the start waits for an island, and the bound of a transfer "
                "nothing abandons first. Past it the run ends naming the islands waited for. The island's own "
                "process group gets a timeout of at least twice this.")
    exchange_chunk_mib: float | None = setting(
        1024.0, "Exchange the flat pseudo-gradient in chunks of this many MiB of fp32 (whole codec blocks), one "
                "after another, so the leader holds one chunk's copies at a time; null or 0: one chunk. Top-k keeps "
                "its fraction of each chunk.")
    exclude_norm_ratio: float | None = setting(
        16.0, "A round merges without an island whose pseudo-gradient is not finite or whose norm exceeds this "
              "many times the (lower) median of the islands' norms (0 or null: only non-finite ones); that island "
              "adopts the merged result.")
    fragments: int = setting(
        1, "Streaming DiLoCo: split the parameters into this many fragments of whole blocks; a round syncs one, "
           "every H / F inner steps in turn, so each still syncs every H steps while the bytes of one sync (and "
           "the peak bandwidth) drop about F times. H must be a multiple of F.")
    fragment_layout: str = setting("strided", "`strided` (fragment f: blocks f, f + F, ...) or `sequential`.")
    overlap_steps: int = setting(
        0, "tau: a round's exchange runs in the background while the island takes this many more inner steps, "
           "then the outer step lands (0: wait for it). One fragment in flight: tau < H / F. The last round never "
           "overlaps.")
    overlap_alpha: float = setting(
        0.0, "With overlap, a fragment's local parameters become `global + alpha * (local - global)` when its outer "
             "step lands (0: the new global parameters; 1: keep local).")
    topology: str = setting(
        "allreduce", "Who mixes with whom in a round: `allreduce` (every island merges every island's pseudo-gradient; "
                     "the islands hold one global state) or `butterfly` (stage k of a fragment's rounds pairs island i "
                     "with island i XOR 2^k; each island steps its own global model with its own outer momentum and "
                     "mixes the result with its partners', receiving one payload per round; docs/ARCHITECTURE.md, "
                     "butterfly; with `expert_weighting` each expert's rows mix by the tokens the group routed to "
                     "it; with `overlap_steps` the mix flies while the island trains, and a repair waits for its "
                     "landing).")
    exchange: str = setting(
        "leader", "Which ranks move a round's bytes between islands: `leader` (each island's rank 0 gathers the "
                  "fragment, encodes, exchanges and scatters it) or `sliced` (the fragment is cut into as many "
                  "slices, on codec blocks, as the smallest island present has ranks; rank r of every island "
                  "gathers, encodes and exchanges slice r over lanes of its own; docs/ARCHITECTURE.md, sliced). "
                  "With `overlap_steps` every rank moves its slices in a thread of its own.")
    max_staleness: int = setting(
        0, "S: an island alive but slow is not waited for past `staleness_wait_s` (null: `grace_s`) once a "
           "majority of the islands alive has arrived; the round goes on without it, and its pseudo-gradient is "
           "merged into a later round, at most S rounds old, its weight its tokens times `staleness_decay` per "
           "round of age; it then adopts the newer global state (an overlapped round is caught up in its "
           "background thread while the island trains). 0: every round waits for every island alive (a barrier).")
    staleness_decay: float = setting(
        0.5, "With `max_staleness`: the factor a late pseudo-gradient's merge weight takes per round of age "
             "(1: tokens alone).")
    staleness_wait_s: float | None = setting(
        None, "With `max_staleness`: how long an island that reached the round waits for islands alive but not "
              "arrived once a majority of the islands alive is there (0: not at all; checked every 0.25 s); null: "
              "`grace_s`. Unlike `grace_s`, which tells a dead island from a slow one, it may be shorter than a "
              "step. An island whose status says it arrives later than that (its steps left at its pace, or it "
              "is a round behind) is not waited for at all.")
    min_islands: int = setting(
        1, "The fewest islands a round may go on with. A round proceeds with the islands that arrive; one silent "
           "for `grace_s` is left out (the merge renormalized) and taken back when it restarts. Fewer alive ends "
           "the run naming them.")
    grace_s: float | None = setting(
        None, "How long an island may make no progress (no step, validation batch, checkpoint write, or wait or "
              "transfer within its deadline) before the others go on without it; null: this island's last round "
              "length, at least 10 s. It must exceed the longest step.")
    on_end: str = setting(
        "stop", "What this island's end of training (its `max_steps`, `max_rounds`, or a callback stopping the "
                "trainer) means for the run: `stop` ends every island after that round; `leave` retires this island "
                "for good: its last round counts, then the others go on without it (its tokens stop counting, no "
                "round waits for it). Per island.")

    # settings each island chooses for itself; the rest is the run's (a joining island adopts them)
    PER_ISLAND = ("steps_per_round", "outer_device", "on_end")

    @classmethod
    def help(cls, name: str) -> str:
        """The help text of the setting ``name``."""
        return {f.name: f.metadata["help"] for f in fields(cls)}[name]

    @classmethod
    def names(cls) -> list[str]:
        """Every setting's name, in declaration order."""
        return [f.name for f in fields(cls)]

    @classmethod
    def with_values(cls, base: IslandSettings | None, values: Mapping[str, Any], where: str) -> IslandSettings:
        """``base`` (or the defaults) with ``values`` replaced; an unknown name is a TypeError that names
        it, the closest setting and where the settings are listed."""
        unknown = sorted(set(values) - set(cls.names()))
        if unknown:
            close = {name: difflib.get_close_matches(name, cls.names(), 1) for name in unknown}
            hints = [f"{name!r} (did you mean {close[name][0]!r}?)" if close[name] else repr(name) for name in unknown]
            raise TypeError(f"{where} got unknown setting(s) {', '.join(hints)}; the settings are the fields of "
                            "IslandSettings (docs/SETTINGS.md); the launcher's (link, members, max_restarts) are "
                            "options of `lightning-islands run` and keys of the Hydra app's islands group")
        if base is not None and not isinstance(base, IslandSettings):
            raise TypeError(f"{where}'s first argument is an IslandSettings, got {base!r}; pass settings by name, "
                            "e.g. IslandStrategy(sync_every=50)")
        return replace(base, **values) if base is not None else cls(**values)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], steps_per_round: int | None = None) -> IslandSettings:
        """The settings among ``values`` (a job's ``islands`` group: other keys, the launcher's, are
        ignored); ``steps_per_round`` (one island's) replaces the group's own."""
        names = cls.names()
        chosen = {k: v for k, v in values.items() if k in names}
        if steps_per_round is not None:
            chosen["steps_per_round"] = steps_per_round
        return cls(**chosen)

    def adopt(self, published: Mapping[str, Any]) -> IslandSettings:
        """The run's settings ``published`` (a dict of every setting, as the islands that started the
        run publish it) with this island's own :attr:`PER_ISLAND` settings: what a joining island
        trains with."""
        names = self.names()
        unknown = sorted(set(published) - set(names))
        if unknown:
            raise ValueError(f"the run publishes settings {unknown} this version of lightning_islands does not know; "
                             "run the same version on every island")
        return replace(self, **{k: v for k, v in published.items() if k not in self.PER_ISLAND})

    @property
    def use_error_feedback(self) -> bool:
        """Whether the error-feedback residual is kept (``error_feedback``, or the codec's default)."""
        return default_error_feedback(self.codec) if self.error_feedback is None else bool(self.error_feedback)

    @property
    def rejoin_every(self) -> int:
        """The rounds a late island may be taken into: with ``max_staleness`` and ``overlap_steps``
        its round thread holds a snapshot of one fragment, so only that fragment's rounds (every
        ``fragments``); else any."""
        return self.fragments if self.max_staleness and self.overlap_steps else 1

    @property
    def exchange_chunk(self) -> int | None:
        """Values per exchange chunk: whole codec blocks and packing groups (``None``: one chunk)."""
        return outer.exchange_chunk_numel(self.exchange_chunk_mib, self.make_codec().alignment)

    def __post_init__(self) -> None:
        check_types(self, "islands")
        self.sync_warmup = sync_warmup_list(self.sync_warmup)
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0 (islands.deadline_s), got {self.deadline_s!r}")
        if self.min_islands < 1:
            raise ValueError(f"min_islands must be an int >= 1 (islands.min_islands), got {self.min_islands!r}")
        if self.grace_s is not None and not self.grace_s > 0:
            raise ValueError(f"grace_s must be > 0 or null (the expected round length), got {self.grace_s!r}")
        if self.sync_every < 1:
            raise ValueError(f"sync_every (H) must be >= 1, got {self.sync_every}")
        if self.weighting not in ("tokens", "equal"):
            raise ValueError(f"weighting must be 'tokens' or 'equal', got {self.weighting!r}")
        if self.on_end not in ("stop", "leave"):
            raise ValueError(f"on_end must be 'stop' or 'leave' (islands.on_end), got {self.on_end!r}")
        if self.balance not in ("none", "time"):
            raise ValueError(f"balance must be 'none' or 'time', got {self.balance!r}")
        if self.max_tokens is not None and (self.max_tokens < 1 or self.fragments != 1 or self.overlap_steps):
            raise ValueError(f"max_tokens must be >= 1 or null and needs fragments=1 and overlap_steps=0 "
                             f"(islands.max_tokens), got max_tokens={self.max_tokens} with fragments={self.fragments}, "
                             f"overlap_steps={self.overlap_steps}")
        if self.max_rounds is not None and self.max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1 or None, got {self.max_rounds}")
        if self.steps_per_round is not None and self.steps_per_round < 1:
            raise ValueError(f"steps_per_round must be >= 1 or null (sync_every), got {self.steps_per_round}")
        self._check_streaming()
        self._check_topology()
        if self.lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {self.lanes}")
        self.outer_optimizer()  # validates the outer step's settings
        self.exchange_chunk  # noqa: B018  (validates exchange_chunk_mib against the codec's blocks)
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
        if f < 1:
            raise ValueError(f"fragments must be an int >= 1 (islands.fragments), got {f!r}")
        if self.fragment_layout not in LAYOUTS:
            raise ValueError(f"fragment_layout must be one of {LAYOUTS} (islands.fragment_layout), "
                             f"got {self.fragment_layout!r}")
        uneven = [h for h in [*self.sync_warmup, self.sync_every] if h % f]
        if uneven:
            raise ValueError(f"with {f} fragments every H must be a multiple of {f} (a fragment syncs every H / F "
                             f"steps), but H={uneven[0]} is not; change islands.sync_every/sync_warmup or "
                             "islands.fragments")
        if not 0 <= tau < self.sync_every // f:
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

    def _check_topology(self) -> None:
        """``topology`` and what it does not combine with yet."""
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES} (islands.topology), got {self.topology!r}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0 (islands.max_staleness), got {self.max_staleness}")
        if not 0.0 < self.staleness_decay <= 1.0:
            raise ValueError(f"staleness_decay must be in (0, 1] (islands.staleness_decay), got {self.staleness_decay}")
        if self.staleness_wait_s is not None and not (self.staleness_wait_s >= 0
                                                      and math.isfinite(self.staleness_wait_s)):
            raise ValueError(f"staleness_wait_s must be a number >= 0 or null (islands.staleness_wait_s), got "
                             f"{self.staleness_wait_s!r}")
        if self.max_staleness and self.overlap_steps and self.topology == "butterfly":
            raise ValueError(f"max_staleness={self.max_staleness} with overlap_steps={self.overlap_steps} needs "
                             "topology=allreduce (a round's thread catches a late island up in a later round, another "
                             "butterfly stage's than its snapshot's); set islands.topology=allreduce, or one of "
                             "max_staleness and overlap_steps to 0")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES} (islands.exchange), got {self.exchange!r}")

    def make_codec(self) -> Codec:
        """The wire format of pseudo-gradients."""
        return make_codec(self.codec, block_size=self.block_size)

    def outer_optimizer(self) -> outer.OuterSGD:
        """A fresh outer optimizer (``outer_lr=1, outer_momentum=0``: plain averaging; Nesterov needs
        momentum, so it is off then)."""
        return outer.OuterSGD(lr=self.outer_lr, momentum=self.outer_momentum,
                              nesterov=self.nesterov and self.outer_momentum > 0,
                              lr_warmup=self.outer_lr_warmup, momentum_warmup=self.outer_momentum_warmup)

    def fingerprint(self, layout: CanonicalLayout, resuming: bool,
                    training_device: torch.device | str) -> dict[str, Any]:
        """What must be equal on every island for the merge to make sense (not how many islands there
        are: islands join and retire while a run goes on)."""
        described = layout.describe()
        return {
            "parameters": hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16],
            "num_parameters": layout.numel,
            "num_tensors": len(layout.entries),
            "first_tensors": described[:3],
            "sync_every": self.sync_every,
            "sync_warmup": self.sync_warmup,
            "outer": self.outer_optimizer().settings(),
            "codec": self.make_codec().spec(),
            "exchange_chunk": self.exchange_chunk,
            "weighting": self.weighting,
            "expert_weighting": self.expert_weighting,
            "balance": self.balance,
            "max_rounds": self.max_rounds,
            "max_tokens": self.max_tokens,
            "fragments": [self.fragments, self.fragment_layout],
            "exclude_norm_ratio": self.exclude_norm_ratio,
            "overlap": [self.overlap_steps, self.overlap_alpha],
            "topology": self.topology,
            "exchange": self.exchange,
            "staleness": [self.max_staleness, self.staleness_decay],
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


def compare_fingerprints(prints: Sequence[dict[str, Any]], islands: Sequence[int] | None = None) -> str | None:
    """A message naming every field in which an island differs from island 0, or ``None``;
    ``islands``: the index of each print (default: its position)."""
    problems = []
    names = list(islands) if islands is not None else list(range(len(prints)))
    for i, fp in zip(names[1:], prints[1:]):
        for key in sorted(set(prints[0]) | set(fp)):
            a, b = prints[0].get(key), fp.get(key)
            if a != b:
                problems.append(f"island {i} has {key}={b!r} but island 0 has {key}={a!r}")
    if not problems:
        return None
    return ("islands disagree before the first step; make their model and island settings equal:\n  "
            + "\n  ".join(problems))
