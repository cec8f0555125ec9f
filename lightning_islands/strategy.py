"""IslandStrategy: FSDP2 inside an island, DiLoCo outer steps across islands (Lightning glue only).

The math is in :mod:`lightning_islands.outer`, the wire format in :mod:`lightning_islands.codecs`,
the network in :mod:`lightning_islands.transport` and the shard bookkeeping in
:mod:`lightning_islands.canonical`. This file decides *when* things happen in Lightning's life cycle:

- ``setup``: shard the module, then meet the other islands (fingerprint check, initial parameters
  from island 0, anchors taken from them before any inner step);
- ``optimizer_step``: marks that the current batch stepped; the batch is closed at the next
  boundary (next batch, validation, end of training), and every ``steps_per_round`` closed batches
  the outer step runs;
- ``on_validation_start``/``end``: validation sees the global parameters;
- ``save_checkpoint``/``load_checkpoint``: the outer state travels with the checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_islands import floatenv, outer
from lightning_islands.canonical import CanonicalLayout
from lightning_islands.codecs import check_decay, default_error_feedback, make_codec, with_residual
from lightning_islands.codecs.buffers import Buffers
from lightning_islands.fsdp import FSDP2Strategy
from lightning_islands.parallel import local_view, reshard_all
from lightning_islands.roundstats import RoundStats, sum_sq
from lightning_islands.transport import (
    ENV_COORDINATOR,
    ENV_ISLAND,
    ENV_NUM_ISLANDS,
    ENV_RUN_ID,
    IslandAborted,
    IslandLink,
)

_OUTER_DIR = "islands_outer"
_EF_FILE = "islands_error_feedback.pt"  # the leader's whole residual, as checkpoints before chunking saved it


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError as err:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from err


def _sync_warmup(value: Any) -> list[int]:
    """``sync_warmup`` as a list of positive ints, or a ValueError naming the expected form."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in value):
        raise ValueError(f"sync_warmup must be a list of H values (ints >= 1), one per early round, e.g. "
                         f"[10, 20, 40] (Hydra: islands.sync_warmup=[10,20,40]); got {value!r}")
    return [int(h) for h in value]


def batch_weight(module: pl.LightningModule, batch: Any) -> int:
    """Tokens in ``batch``: the module's ``tokens_per_batch(batch)`` if it has one, else the number
    of elements of the first tensor found (for ``(B, T)`` token ids: tokens; for other inputs: the
    leading dimension)."""
    fn = getattr(module, "tokens_per_batch", None)
    if callable(fn):
        return int(fn(batch))
    stack = [batch]
    while stack:
        item = stack.pop(0)
        if isinstance(item, Tensor):
            return int(item.numel()) if item.dim() <= 2 else int(item.shape[0])
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return 1


class IslandStrategy(FSDP2Strategy):
    """Train one model on several islands: FSDP2 inside each, DiLoCo outer steps between them.

    Each island is its own torch.distributed world (torchrun, SLURM, ...). Every ``sync_every``
    inner steps each island computes its pseudo-gradient ``anchor - params``, quantizes it with
    ``codec``, all islands exchange the payloads through the coordinator's lanes, and every island
    merges them (weighted by the tokens each island processed in the round, in island order) and
    takes an outer SGD step on the anchor, which then becomes the island's parameters. Global state
    is bit-identical on all islands after every outer step.

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
        island, num_islands, coordinator, run_id: this island's identity; default from the
            environment (``LI_ISLAND``, ``LI_NUM_ISLANDS``, ``LI_COORDINATOR``, ``LI_RUN_ID``).
        steps_per_round: inner steps this island runs per round (defaults to ``sync_every``; a
            slower island may run fewer, the merge stays token-weighted).
        lanes: parallel TCP streams between islands.
        outer_device: where anchors, outer momentum, the error-feedback residual (each rank its
            shards of all three) and the leader's round exchange (encoding, decoding, merging) live:
            ``"cpu"`` offloads them. ``None``: anchors, momentum and residual on the training device;
            the exchange there too for an island of one process, on the host for larger islands
            (see :meth:`_exchange_device`).
        weighting: ``"tokens"`` (merge weighted by tokens processed) or ``"equal"``.
        expert_weighting: weight each expert's pseudo-gradient by the tokens each island routed to
            that expert in the round (the module must implement ``island_token_counts()`` and
            ``reset_island_token_counts()``, as the provided MoE does).
        balance: ``"none"`` (every island runs ``steps_per_round``) or ``"time"``: after each round
            the islands agree on a wall-clock budget (H times the slowest island's step time) and
            each runs the inner steps that fit, so a fast island does not wait idle.
        max_rounds: stop training after this many outer rounds (needed with ``balance="time"``,
            where islands run different numbers of steps; set the Trainer's ``max_steps`` high).
        timeout_s: how long to wait for an island that shows no progress (no step or validation
            batch started), at rendezvous and every round; a slow island that keeps stepping is
            waited for, up to ``max_wait_s``.
        max_wait_s: the longest a round may wait for islands that are still stepping. The island's
            own process group (its ranks other than the leader wait in it meanwhile) gets a
            timeout of at least ``max_wait_s + timeout_s``.
        exchange_chunk_mib: the round exchanges the flat pseudo-gradient in chunks of this many MiB
            of fp32 (rounded down to whole codec blocks and packing groups), one after another:
            gathered to the leader, compensated, encoded, exchanged, decoded, merged and scattered
            back, so the leader holds one chunk's copies at a time (the error-feedback residual stays
            sharded like the anchors: each rank adds its shards before the gather and gets its
            shards of the new residual back). ``None`` or 0: one chunk. Top-k keeps its fraction
            of each chunk. Part of the fingerprint.
        unit_classes, reshard_after_forward, process_group_backend: as :class:`FSDP2Strategy`.
    """

    strategy_name = "islands"

    def __init__(
        self,
        sync_every: int = 50,
        sync_warmup: Sequence[int] | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        outer_lr_warmup: int = 0,
        outer_momentum_warmup: int = 0,
        codec: str = "fp32",
        block_size: int = 128,
        error_feedback: bool | None = None,
        error_feedback_decay: float = 1.0,
        island: int | None = None,
        num_islands: int | None = None,
        coordinator: str | None = None,
        run_id: str | None = None,
        steps_per_round: int | None = None,
        lanes: int = 2,
        outer_device: str | None = None,
        weighting: str = "tokens",
        expert_weighting: bool = False,
        balance: str = "none",
        max_rounds: int | None = None,
        timeout_s: float = 600.0,
        max_wait_s: float = 3600.0,
        exchange_chunk_mib: float | None = 1024.0,
        unit_classes: Sequence[str] | None = None,
        reshard_after_forward: bool = True,
        process_group_backend: str | None = None,
    ) -> None:
        if timeout_s <= 0 or max_wait_s <= 0:
            raise ValueError(f"timeout_s and max_wait_s must be > 0, got {timeout_s} and {max_wait_s}")
        super().__init__(
            unit_classes=unit_classes,
            reshard_after_forward=reshard_after_forward,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            # the leader may wait up to max_wait_s for other islands while the other ranks wait for it
            timeout=max(default_pg_timeout, timedelta(seconds=max_wait_s + timeout_s)),
        )
        if sync_every < 1:
            raise ValueError(f"sync_every (H) must be >= 1, got {sync_every}")
        self.sync_warmup = _sync_warmup(sync_warmup)
        if weighting not in ("tokens", "equal"):
            raise ValueError(f"weighting must be 'tokens' or 'equal', got {weighting!r}")
        if balance not in ("none", "time"):
            raise ValueError(f"balance must be 'none' or 'time', got {balance!r}")
        if max_rounds is not None and max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1 or None, got {max_rounds}")
        self.sync_every = sync_every
        self._fixed_steps = steps_per_round
        self.steps_per_round = self._planned_steps(0)
        # outer_lr=1, outer_momentum=0 is plain averaging; Nesterov needs momentum, so it is off then.
        self.outer_opt = outer.OuterSGD(lr=outer_lr, momentum=outer_momentum,
                                        nesterov=nesterov and outer_momentum > 0,
                                        lr_warmup=outer_lr_warmup, momentum_warmup=outer_momentum_warmup)
        self.codec = make_codec(codec, block_size=block_size)
        # whole blocks and packing groups per chunk: a chunked round sends the values one chunk would
        self.exchange_chunk = outer.exchange_chunk_numel(exchange_chunk_mib, self.codec.alignment)
        self.use_error_feedback = default_error_feedback(codec) if error_feedback is None else error_feedback
        self.error_feedback_decay = check_decay(error_feedback_decay,
                                                "error_feedback_decay (islands.error_feedback_decay)")
        if error_feedback_decay != 1.0 and not self.use_error_feedback:
            why = "error_feedback=False" if error_feedback is False else f"the default for codec {codec!r}"
            raise ValueError(f"error_feedback_decay={error_feedback_decay} decays the error-feedback residual, but "
                             f"error feedback is off ({why}): set error_feedback=True "
                             "(islands.error_feedback=true) or leave the decay at 1")
        self.island_index = island if island is not None else (_env_int(ENV_ISLAND) or 0)
        self.num_islands = num_islands if num_islands is not None else (_env_int(ENV_NUM_ISLANDS) or 1)
        self.coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
        self.run_id = run_id or os.environ.get(ENV_RUN_ID) or "islands"
        if self.num_islands > 1 and not self.coordinator:
            raise ValueError(
                f"{self.num_islands} islands need a coordinator address: pass coordinator='HOST:PORT' or set "
                f"{ENV_COORDINATOR} (`lightning-islands run` sets it for you)"
            )
        if not 0 <= self.island_index < self.num_islands:
            raise ValueError(f"island index {self.island_index} is outside [0, {self.num_islands})")
        self.lanes = lanes
        self.outer_device = outer_device
        self.weighting = weighting
        self.expert_weighting = expert_weighting
        self.balance = balance
        self.max_rounds = max_rounds
        self.timeout = timedelta(seconds=timeout_s)
        self.max_wait = timedelta(seconds=max_wait_s)
        self._round_started = time.perf_counter()
        self._round_val_seconds = 0.0
        self._val_started: float | None = None

        self.link: IslandLink | None = None
        self.layout: CanonicalLayout | None = None
        # whether island 0's initial state had to be broadcast (None until the islands have met)
        self.initial_state_broadcast: bool | None = None
        self._state_exchanges = 0
        # this rank's shards of the error-feedback residual (what quantization dropped, for the next
        # round), shaped and placed like the anchors; None before the first round or without it
        self.residual: list[Tensor] | None = None
        self._params: list[Tensor] = []
        self._anchors: list[Tensor] = []
        self._stash: list[Tensor] | None = None
        self._stepped_batch = False
        self.inner_steps = 0
        self.round_steps = 0
        self.round = 0
        self.round_tokens = 0
        self.total_tokens = 0
        self.totals: dict[str, float] = {"bytes_sent": 0.0, "bytes_received": 0.0,
                                         "seconds_exchanging": 0.0, "seconds_waiting": 0.0}
        self.last_round_metrics: dict[str, float] = {}
        self.round_callbacks: list[Callable[[IslandStrategy], None]] = []
        self._last_status = 0.0
        self._beats = 0
        self._stopping = False  # the islands agreed to stop: no further rounds start
        self._start_agreed = False  # this fit took part in the islands' start agreement
        self._resuming = False
        self._timed_steps = 0  # steps closed since _round_started (step time excludes restarts)
        self._untimed_first_step = False  # set at the start of a fit: its first step is not timed

    # ------------------------------------------------------------------ identity and rendezvous
    @property
    def is_leader(self) -> bool:
        """Whether this process is its island's rank 0 (the one that talks to other islands)."""
        return self.global_rank == 0

    def fingerprint(self) -> dict[str, Any]:
        """What must be equal on every island for the merge to make sense."""
        assert self.layout is not None
        model = hashlib.sha256(json.dumps(self.layout.describe()).encode()).hexdigest()[:16]
        return {
            "parameters": model,
            "num_parameters": self.layout.numel,
            "num_tensors": len(self.layout.entries),
            "first_tensors": self.layout.describe()[:3],
            "num_islands": self.num_islands,
            "sync_every": self.sync_every,
            "sync_warmup": self.sync_warmup,
            "outer": self.outer_opt.settings(),
            "codec": self.codec.spec(),
            "exchange_chunk": self.exchange_chunk,
            "weighting": self.weighting,
            "expert_weighting": self.expert_weighting,
            "balance": self.balance,
            "max_rounds": self.max_rounds,
            "resuming": bool(self._resuming),
            # the merge and the outer step (on the host or the training device) give the same bits on
            # every island only where the float modes agree
            "subnormals": {"host": floatenv.describe("cpu"), "training_device": floatenv.describe(self.root_device)},
        }

    @staticmethod
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

    def _agree(self, leader_work: Callable[[], Any]) -> Any:
        """Run ``leader_work`` on the leader; every rank of the island gets its result, or its error.

        A failure on the leader is re-raised on every rank (and reported to the other islands),
        instead of leaving the island's other ranks waiting in a collective.
        """
        box: tuple[str, Any] = ("ok", None)
        if self.is_leader:
            try:
                box = ("ok", leader_work())
            except Exception as err:  # noqa: BLE001 - forwarded to every rank below
                message = f"island {self.island_index}: {type(err).__name__}: {err}"
                if self.link is not None and not isinstance(err, IslandAborted):
                    with suppress(Exception):
                        self.link.abort(message)
                box = ("error", message)
        box = self.broadcast(box)
        if box[0] == "error":
            raise RuntimeError(box[1])
        return box[1]

    def _outer_tensor(self, t: Tensor) -> Tensor:
        device = torch.device(self.outer_device) if self.outer_device else t.device
        return t.detach().to(device=device, dtype=torch.float32, copy=True)

    def _exchange_device(self) -> torch.device:
        """Where the leader runs the round's exchange (encode, decode, merge).

        ``outer_device`` if set. Else the training device when the island is one process: on a GPU
        the codecs run their Triton kernels there and only payloads cross to the host. An island of
        several processes exchanges on the host, because the leader holds several unsharded fp32
        copies of a chunk (up to ``exchange_chunk_mib`` each) meanwhile, on top of its own shards,
        which a model sharded to fit its GPUs may not leave room for. (The other ranks hold only
        their shards: the round gathers to the leader and scatters from it.)
        """
        if self.outer_device:
            return torch.device(self.outer_device)
        return self.root_device if self.world_size == 1 else torch.device("cpu")

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._start_agreed = False
            self._resuming = trainer.ckpt_path is not None
            self._rendezvous()

    def _rendezvous(self) -> None:
        module = self.lightning_module
        assert module is not None
        if self.expert_weighting and not callable(getattr(module, "island_token_counts", None)):
            raise TypeError(
                f"expert_weighting=True needs the module to implement island_token_counts() and "
                f"reset_island_token_counts(); {type(module).__name__} does not (or set expert_weighting=False)"
            )
        named = list(module.named_parameters())
        self._params = [p for _, p in named]
        self._anchors = []
        self.layout = CanonicalLayout(named)
        if self.num_islands > 1:
            self._agree(self._meet)
        self._adopt_island0_state()

    def _meet(self) -> None:
        """Leader: join the coordinator, compare fingerprints through the store, then open the lanes."""
        assert self.coordinator is not None and self.layout is not None
        try:
            self.link = IslandLink(self.coordinator, self.island_index, self.num_islands,
                                   run_id=self.run_id, lanes=self.lanes, timeout=self.timeout,
                                   max_wait=self.max_wait)
        except Exception as err:
            raise RuntimeError(f"could not meet the other islands: {err}") from err
        error = self.compare_fingerprints(self.link.gather_objects("fingerprint", self.fingerprint()))
        if error:
            raise RuntimeError(error)
        self.link.open_lanes()

    @torch.no_grad()
    def _adopt_island0_state(self) -> None:
        """Every island takes island 0's parameters and buffers; anchors are taken from them (fp32).

        Islands first compare a SHA-256 of their full fp32 parameters and buffers: islands built
        from the same seed, or all loaded from the same plain checkpoint, already agree bit for
        bit, and then nothing is broadcast (a full fp32 copy less across the slow link). Otherwise
        island 0's state is broadcast. Runs at setup and again after a plain checkpoint is loaded.
        """
        assert self.layout is not None
        if self.num_islands > 1:
            reshard_all(self.lightning_module)  # type: ignore[arg-type]
            mine = self.layout.gather([local_view(p).detach() for p in self._params], self._params)
            # Called at setup and again after loading a plain checkpoint: each exchange its own key.
            self._state_exchanges += 1
            key = f"initial_state/{self._state_exchanges}"
            found = self._agree(lambda: self.link.gather_objects(key, self._state_digest(mine)))  # type: ignore
            self.initial_state_broadcast = len(set(found)) != 1
            if not self.initial_state_broadcast:
                self._anchors = [self._outer_tensor(self.layout.shard_of(mine, i, p))
                                 for i, p in enumerate(self._params)]
            elif self.island_index == 0:
                self._agree(lambda: self.link.broadcast_bytes(mine.cpu().view(torch.uint8), src=0))  # type: ignore
                self._adopt_island0_buffers()
            else:
                flat = self._agree(lambda: self.link.broadcast_bytes(None, src=0).view(torch.float32))  # type: ignore
                flat = self._island_broadcast_tensor(flat, self.layout.numel)
                shards = [self.layout.shard_of(flat, i, p) for i, p in enumerate(self._params)]
                for p, shard in zip(self._params, shards):
                    local_view(p).copy_(shard)
                # Anchors from the fp32 bytes received, not from parameters that may hold fewer bits.
                self._anchors = [self._outer_tensor(shard) for shard in shards]
                self._adopt_island0_buffers()
        if not self._anchors:
            self._anchors = [self._outer_tensor(local_view(p)) for p in self._params]

    def _state_digest(self, flat: Tensor) -> str:
        """SHA-256 of the full fp32 parameters and of every buffer (name, dtype, shape, bytes)."""
        h = hashlib.sha256(flat.cpu().numpy())
        for name, buf in self.lightning_module.named_buffers():  # type: ignore[union-attr]
            h.update(f"{name}:{buf.dtype}:{tuple(buf.shape)}".encode())
            h.update(buf.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
        return h.hexdigest()

    def _adopt_island0_buffers(self) -> None:
        """Island 0 sends its buffers, the others load them (every island has the same module)."""
        module = self.lightning_module
        assert module is not None
        buffers = dict(module.named_buffers())
        if not buffers:
            return
        if self.island_index == 0:
            blob = io.BytesIO()
            torch.save({k: v.detach().cpu() for k, v in buffers.items()}, blob)
            payload = torch.frombuffer(bytearray(blob.getvalue()), dtype=torch.uint8)
            self._agree(lambda: self.link.broadcast_bytes(payload, src=0))  # type: ignore[union-attr]
            return
        data = self._agree(lambda: self.link.broadcast_bytes(None, src=0).numpy().tobytes())  # type: ignore
        received = torch.load(io.BytesIO(data), weights_only=True)
        for name, buf in buffers.items():
            if name in received:
                buf.copy_(received[name].to(buf.device))

    def _island_broadcast_tensor(self, flat: Tensor | None, numel: int) -> Tensor:
        """Broadcast the leader's fp32 flat vector to every rank of this island."""
        device = self.root_device
        buf = flat.to(device) if flat is not None else torch.empty(numel, dtype=torch.float32, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(buf, src=0)
        return buf

    # ------------------------------------------------------------------ inner steps and rounds
    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._stepped_batch = True
        if self._ends_last_round():
            # The round runs when the next batch starts, and Lightning trains a batch it has started:
            # stop after this one instead, and on_train_end runs the round (no unmerged extra step).
            self.lightning_module.trainer.should_stop = True  # type: ignore[union-attr]
        return out

    def _ends_last_round(self) -> bool:
        """Whether the step just taken completes round ``max_rounds`` (every island knows it alike)."""
        return (bool(self._anchors) and not self._stopping and self._in_round_max_rounds()
                and self.round_steps + 1 >= self.steps_per_round)

    def _in_round_max_rounds(self) -> bool:
        """Whether the current round is round ``max_rounds``, the last one allowed."""
        return self.max_rounds is not None and self.round + 1 >= self.max_rounds

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._close_batch()
        super().on_train_batch_start(batch, batch_idx)
        if self._anchors:
            self.round_tokens += batch_weight(self.lightning_module, batch)  # type: ignore[arg-type]
        self._publish_status()

    def _close_batch(self) -> None:
        if not self._stepped_batch or not self._anchors:
            return
        self._stepped_batch = False
        self.inner_steps += 1
        self.round_steps += 1
        self._timed_steps += 1
        if self._untimed_first_step:
            # The first step of a fit also pays for starting the data loader (and any warm-up):
            # time this round from its end, unless it is the round's only step.
            self._untimed_first_step = False
            if self.round_steps < self.steps_per_round:
                self._restart_round_clock()
        if self.round_steps >= self.steps_per_round and not self._stopping:
            self.outer_step()

    def _island_sum(self, value: float) -> float:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.root_device)
        dist.all_reduce(t)
        return float(t.item())

    def _wants_stop(self, final: bool) -> bool:
        """Whether this round is this island's last: it is ending training (``final``, ``max_steps``
        reached, or a callback asked the trainer to stop) or ``max_rounds`` is reached. Any island's
        last round is everyone's."""
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        if final or trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step:
            return True
        return self._in_round_max_rounds()

    @torch.no_grad()
    def outer_step(self, final: bool = False) -> dict[str, float]:
        """Run one round's exchange and outer step now (every rank of every island must call it).

        ``final``: this island is ending training (its last, possibly partial or empty, round); the
        others learn it through the round header and stop after this round too.
        """
        assert self.layout is not None
        t_start = time.perf_counter()
        reshard_all(self.lightning_module)  # type: ignore[arg-type]
        locals_ = [local_view(p) for p in self._params]
        deltas = [outer.pseudo_gradient(a.to(loc.device), loc) for a, loc in zip(self._anchors, locals_)]
        # the pseudo-gradient's squared norm (a plain, replicated tensor counts once: on rank 0)
        delta_sq = self._island_sum(sum_sq([d for d, p in zip(deltas, self._params)
                                            if self.layout.is_sharded(p) or self.global_rank == 0]))
        sent = deltas
        if self.use_error_feedback:  # each rank adds its shards of (a share of) what the last rounds dropped
            if self.residual is None:
                self.residual = [torch.zeros_like(a) for a in self._anchors]
            else:
                decay = self.error_feedback_decay
                sent = [with_residual(d, r.to(d.device), decay) for d, r in zip(deltas, self.residual)]
        tokens = self._island_sum(float(self.round_tokens))
        step_seconds = (t_start - self._round_started - self._round_val_seconds) / max(1, self._timed_steps)
        header = {"round": self.round, "tokens": tokens, "steps": self.round_steps, "step_seconds": step_seconds,
                  "experts": self._expert_counts(), "stop": self._wants_stop(final)}
        coefs: dict[str, list[Tensor]] = {}  # the leader's per-expert merge coefficients of this round
        headers = self._agree(lambda: self._meet_round(header, coefs))
        if any(h["stop"] for h in headers):
            self._stopping = True
            self.lightning_module.trainer.should_stop = True  # type: ignore[union-attr]
        if not any(h["steps"] > 0 for h in headers):
            # Every island ended exactly at a round boundary: this exchange only agreed to stop, and an
            # outer step on zero pseudo-gradients would still move the anchor by the momentum.
            return {}
        grads, metrics = self._exchange(sent, delta_sq, headers, coefs)
        metrics.update(self._expert_gap_metrics(headers))
        next_steps = self._next_round_steps(headers)
        self.outer_opt.step(self._anchors, grads)
        metrics.update({"islands/outer_lr": self.outer_opt.lr_at(self.outer_opt.steps),
                        "islands/outer_momentum": self.outer_opt.momentum_at(self.outer_opt.steps)})
        for p, a in zip(self._params, self._anchors):
            local_view(p).copy_(a.to(device=local_view(p).device, dtype=local_view(p).dtype))
        self.round += 1
        self.round_steps = 0
        self.total_tokens += int(tokens)
        self.round_tokens = 0
        self.steps_per_round = next_steps
        metrics.update({"islands/round": float(self.round), "islands/inner_steps": float(self.inner_steps),
                        "islands/round_tokens": tokens, "islands/step_seconds": step_seconds,
                        "islands/steps_per_round": float(self.steps_per_round),
                        "islands/seconds_outer_step": time.perf_counter() - t_start})
        metrics.update({f"islands/total_{k}": v for k, v in self.totals.items()})
        self.last_round_metrics = metrics
        self._log(metrics)
        for callback in self.round_callbacks:
            callback(self)
        self._restart_round_clock()
        return metrics

    def _restart_round_clock(self) -> None:
        """Time the round (step time for ``balance="time"``) from now: no steps, no validation yet."""
        self._round_started = time.perf_counter()
        self._round_val_seconds = 0.0
        self._timed_steps = 0

    def _expert_counts(self) -> dict[str, list[float]] | None:
        """This island's tokens per expert in the round, per expert parameter (island collective)."""
        module = self.lightning_module
        if not self.expert_weighting or module is None:
            return None
        counts = module.island_token_counts()  # type: ignore[operator]
        names = [e.name for e in self.layout.entries if e.name in counts]  # type: ignore[union-attr]
        if not names:
            return {}
        stacked = torch.stack([counts[n].to(torch.float64) for n in names])
        if dist.is_initialized() and dist.get_world_size() > 1:
            stacked = stacked.to(self.root_device)
            dist.all_reduce(stacked)
        module.reset_island_token_counts()  # type: ignore[operator]
        return {n: row.cpu().tolist() for n, row in zip(names, stacked)}

    def _island_weights(self, headers: Sequence[dict[str, Any]]) -> list[float]:
        """Each island's merge weight from the round headers: its tokens, or 1 with ``weighting="equal"``."""
        return [1.0 if self.weighting == "equal" else float(h["tokens"]) for h in headers]

    def _expert_gap_metrics(self, headers: Sequence[dict[str, Any]]) -> dict[str, float]:
        """With expert weighting: how far the per-expert coefficients were from the islands' merge
        weights this round (largest, and token-weighted mean over experts, averaged over the expert
        parameters); nothing without it."""
        names = list(headers[0]["experts"] or {})
        if not names:
            return {}
        weights = self._island_weights(headers)
        gaps = [outer.expert_share_gap([h["experts"][n] for h in headers], weights) for n in names]
        return {"islands/expert_share_gap_max": max(g[0] for g in gaps),
                "islands/expert_share_gap_mean": sum(g[1] for g in gaps) / len(gaps)}

    def round_sync_every(self, round_index: int) -> int:
        """H of round ``round_index`` (counting from 0): ``sync_warmup`` first, then ``sync_every``."""
        if round_index < len(self.sync_warmup):
            return self.sync_warmup[round_index]
        return self.sync_every

    def _planned_steps(self, round_index: int) -> int:
        """This island's inner steps in round ``round_index`` without time balancing."""
        h = self.round_sync_every(round_index)
        if self._fixed_steps is None:
            return h
        return max(1, round(self._fixed_steps * h / self.sync_every))

    def _next_round_steps(self, headers: Sequence[dict[str, Any]]) -> int:
        """The next round's inner steps for this island.

        ``balance="none"``: the next round's H (or this island's fixed steps, scaled by it).
        ``"time"``: the budget is H steps of the slowest island, and each island runs the steps that
        fit it (at most 8 H).
        """
        if self.balance != "time":
            return self._planned_steps(self.round + 1)
        h = self.round_sync_every(self.round + 1)
        times = [max(float(hdr["step_seconds"]), 1e-9) for hdr in headers]
        budget = h * max(times)
        return max(1, min(8 * h, round(budget / times[self.island_index])))

    def _meet_round(self, header: dict[str, Any], coefs: dict[str, list[Tensor]]) -> list[dict[str, Any]]:
        """Leader only: every island's round header, in island order; fills ``coefs`` with the
        per-expert merge coefficients (expert weighting)."""
        headers = [header]
        if self.link is not None:
            t0 = time.perf_counter()
            headers = self.link.gather_objects(f"round{self.round}", header)
            self.link.stats.seconds_waiting += time.perf_counter() - t0
        assert self.layout is not None
        by_name = {e.name: e for e in self.layout.entries}
        for name in headers[0]["experts"] or {}:  # None without expert weighting
            coefs[name] = outer.expert_coefficients([h["experts"][name] for h in headers])
            if by_name[name].shape[0] != coefs[name][0].numel():
                raise ValueError(f"{name} has {by_name[name].shape[0]} rows but {coefs[name][0].numel()} expert counts")
        return headers

    def _exchange(self, sent: Sequence[Tensor], delta_sq: float, headers: Sequence[dict[str, Any]],
                  coefs: dict[str, list[Tensor]]) -> tuple[list[Tensor], dict[str, float]]:
        """Every rank: the merged pseudo-gradient's part for this rank's shards (the outer step's
        gradients), one chunk of the flat vector at a time, from this rank's shards of what the
        island sends (``sent``: the pseudo-gradient plus the decayed error-feedback residual); the new
        residual goes back to the ranks the same way. The round's metrics on the leader."""
        assert self.layout is not None
        weights = self._island_weights(headers)
        stats = RoundStats(len(headers), delta_sq)
        link_sums = {key: 0.0 for key in self.totals}
        chunks = outer.chunk_bounds(self.layout.numel, self.exchange_chunk)
        # one chunk: the scatter's own buffer becomes the gradients; several: each fills its part
        into = None if len(chunks) == 1 else [torch.zeros_like(a) for a in self._anchors]
        scratch = Buffers()  # the leader's chunk-sized temporaries, reused by every chunk of this round
        for start, stop in chunks:
            into_part = scratch.take("part", stop - start, device=self._exchange_device()) if self.is_leader else None
            part = self.layout.gather_to_leader(sent, self._params, self.root_device, self._exchange_device(),
                                                start, stop, into=into_part)
            del into_part  # the same tensor as ``part`` on the leader
            box: dict[str, Tensor] = {}

            def leader_chunk(part: Tensor | None = part, start: int = start, box: dict[str, Tensor] = box) -> None:
                assert part is not None
                box["merged"], box["residual"] = self._exchange_chunk(part, start, weights, coefs, stats, link_sums,
                                                                      scratch)

            self._agree(leader_chunk)
            del part, leader_chunk  # the next chunk reuses the leader's buffers
            if stop == chunks[-1][1]:
                scratch.clear()  # nothing left to reuse: the scatters get their room (merged and residual stay)
            got = self.layout.scatter_from_leader(box.pop("merged", None), self._params, self.root_device, start,
                                                  stop, into=into)
            if self.residual is not None:
                self.layout.scatter_from_leader(box.pop("residual", None), self._params, self.root_device, start,
                                                stop, into=self.residual)
        grads = [g.to(a.device) for g, a in zip(got, self._anchors)]
        if not self.is_leader:
            return grads, {}
        metrics = stats.metrics(error_feedback=self.use_error_feedback)
        metrics["islands/exchange_chunks"] = float(len(chunks))
        if self.link is not None:
            metrics.update({f"islands/{key}": value for key, value in link_sums.items()})
            metrics["islands/cosine"] = stats.cosine()
        return grads, metrics

    def _exchange_chunk(self, part: Tensor, start: int, weights: Sequence[float], coefs: dict[str, list[Tensor]],
                        stats: RoundStats, link_sums: dict[str, float],
                        scratch: Buffers) -> tuple[Tensor, Tensor | None]:
        """Leader only: quantize this chunk of what the island sends once, exchange it, merge every
        island's in island order. Returns the merged chunk and, with error feedback, what
        quantization dropped from it (the chunk of the next residual): both in ``scratch``, valid
        until the next chunk."""
        m, dev = part.numel(), part.device
        payload = self.codec.encode(part, out=scratch.take("payload", self.codec.nbytes(m), torch.uint8, dev),
                                    scratch=scratch)
        own = self.codec.decode(payload, out=scratch.take("own", m, device=dev), scratch=scratch)
        residual = None if self.residual is None else torch.sub(part, own, out=scratch.take("residual", m, device=dev))
        decoded = [own]
        if self.link is not None:
            payloads = self.link.all_gather_bytes(payload)
            decoded = [own if i == self.island_index else
                       self.codec.decode(p.to(dev), out=scratch.take(f"decoded{i}", m, device=dev), scratch=scratch)
                       for i, p in enumerate(payloads)]
            link = self.link.take_stats()
            for key in self.totals:
                self.totals[key] += getattr(link, key)
                link_sums[key] += getattr(link, key)
        merged = outer.merge(decoded, weights, out=scratch.take("merged", m, device=dev),
                             scratch=scratch.take("term", m, device=dev))
        self._merge_experts(merged, decoded, coefs, start)
        stats.add(part, own, payload.numel(), decoded, merged)
        return merged, residual

    def _merge_experts(self, merged: Tensor, decoded: Sequence[Tensor], coefs: dict[str, list[Tensor]],
                       start: int) -> None:
        """Overwrite each expert parameter's values in this chunk of ``merged`` (the flat vector's
        ``[start, start + numel)``) with their per-expert weighted merge."""
        assert self.layout is not None
        stop = start + merged.numel()
        for e in self.layout.entries:
            if e.name not in coefs:
                continue
            a, b = max(e.offset, start), min(e.offset + e.numel, stop)
            if a < b:
                parts = [d[a - start : b - start] for d in decoded]
                merged[a - start : b - start] = outer.merge_expert_rows(parts, coefs[e.name], e.numel // e.shape[0],
                                                                        a - e.offset)

    def _log(self, metrics: dict[str, float]) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not self.is_leader:
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _publish_status(self) -> None:
        if self.link is None or not self.is_leader:
            return
        now = time.monotonic()
        if now - self._last_status < 0.5:
            return
        self._last_status = now
        self._beats += 1
        # "beat" changes every time: islands waiting for this one keep waiting while it does
        status = {**self._status(), "beat": self._beats}
        with suppress(Exception):
            self.link.heartbeat(status)

    def _status(self) -> dict[str, Any]:
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        loss = trainer.callback_metrics.get("train/loss")
        return {"step": trainer.global_step, "round": self.round, "loss": float(loss) if loss is not None else None,
                "bytes": self.totals["bytes_sent"] + self.totals["bytes_received"]}

    def _beating(self, phase: str) -> AbstractContextManager[None]:
        """The leader keeps beating while a long step without training steps runs (a checkpoint
        write): waiting islands see ``phase`` in its status and do not give it up as silent."""
        if self.link is None or not self.is_leader:
            return nullcontext()
        return self.link.beating({**self._status(), "phase": phase})

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._publish_status()  # a long validation is progress too
        return super().validation_step(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self.link is not None and self.is_leader and not isinstance(exception, IslandAborted):
            with suppress(Exception):
                self.link.abort(f"island {self.island_index}: {type(exception).__name__}: {exception}")
        super().on_exception(exception)

    # ------------------------------------------------------------------ global model views
    def _swap_in_global(self) -> None:
        if not self._anchors or self.round_steps == 0 and not self._stepped_batch:
            return
        reshard_all(self.lightning_module)  # type: ignore[arg-type]
        self._stash = [local_view(p).detach().clone() for p in self._params]
        with torch.no_grad():
            for p, a in zip(self._params, self._anchors):
                local_view(p).copy_(a.to(device=local_view(p).device, dtype=local_view(p).dtype))

    def _swap_out_global(self) -> None:
        if self._stash is None:
            return
        reshard_all(self.lightning_module)  # type: ignore[arg-type]
        with torch.no_grad():
            for p, s in zip(self._params, self._stash):
                local_view(p).copy_(s)
        self._stash = None

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._close_batch()
        self._val_started = time.perf_counter()
        self._swap_in_global()

    @override
    def on_validation_end(self) -> None:
        if self._val_started is not None:
            self._round_val_seconds += time.perf_counter() - self._val_started
            self._val_started = None
        self._swap_out_global()
        super().on_validation_end()

    @override
    def on_train_end(self) -> None:
        if self._anchors:
            self._close_batch()
            if not self._stopping:
                # The islands have not agreed to stop yet: this island's last (possibly partial or
                # empty) round tells the others to stop after it, so nobody waits for a missing round.
                self.outer_step(final=True)
            else:
                # Steps after the agreed last round are not merged anywhere: end on the global model.
                self._swap_in_global()
                self._stash = None
        super().on_train_end()

    @torch.no_grad()
    def global_parameters(self) -> dict[str, Tensor]:
        """The full global parameters (fp32, on CPU) by name; a collective inside the island."""
        assert self.layout is not None
        flat = self.layout.gather(list(self._anchors), self._params).cpu()
        return {e.name: flat[e.offset : e.offset + e.numel].view(e.shape).clone() for e in self.layout.entries}

    @torch.no_grad()
    def global_state_digest(self) -> str:
        """SHA-256 of the global parameters and outer momentum in canonical layout (island collective)."""
        assert self.layout is not None
        h = hashlib.sha256()
        h.update(self.layout.gather(self._anchors, self._params).cpu().numpy().tobytes())
        buffers = self.outer_opt.buffers
        if buffers and all(b is not None for b in buffers):
            h.update(self.layout.gather(buffers, self._params).cpu().numpy().tobytes())  # type: ignore[arg-type]
        return h.hexdigest()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if not self._anchors:
            return
        # Validation seconds counted so far (the sanity check) happened before this round started.
        self._restart_round_clock()
        self._untimed_first_step = True
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        more = trainer.max_steps < 0 or trainer.global_step < trainer.max_steps
        self._act_on_start_agreement(self._agree_on_start(more))

    def _agree_on_start(self, more: bool) -> list[int]:
        """The islands' start agreement (an island collective): every island's global state must be
        the same; returns the islands that have no training steps left (``more=False``)."""
        self._start_agreed = True
        if self.num_islands == 1:
            return [] if more else [self.island_index]
        digest = self.global_state_digest()

        def compare() -> list[int]:
            found = self.link.gather_objects(  # type: ignore[union-attr]
                "start", {"digest": digest, "round": self.round, "more": more})
            if len({d["digest"] for d in found}) != 1:
                raise RuntimeError(
                    f"islands start from different global states (at rounds {[d['round'] for d in found]}); "
                    "resume every island from its checkpoint of the same step, or none")
            return [i for i, d in enumerate(found) if not d["more"]]

        return self._agree(compare)

    def _act_on_start_agreement(self, done: list[int]) -> None:
        """Act on the start agreement. ``done``: the islands without steps left.

        Every island has steps: a run resumed from the checkpoint taken after the islands agreed to
        stop (``final.ckpt``) with a raised ``max_steps`` goes on with its rounds. Some island has
        none: no round could complete (that island never joins one), so stop at once.
        """
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        if not done:
            if self._stopping:
                self._stopping = False
                rank_zero_info(f"islands: continuing after round {self.round}, where the previous run ended")
            return
        if self._stopping:
            rank_zero_info(f"islands: this checkpoint is the agreed end of a run (round {self.round}) and not "
                           "every island has steps left; stopping. Raise trainer.max_steps to train further.")
        else:
            rank_zero_warn(f"islands: island(s) {done} have no steps left (trainer.max_steps reached), so no round "
                           f"can complete; not every island has steps left, stopping at round {self.round}. Give "
                           "every island a max_steps above the step it resumes from.")
            self._stopping = True  # the end of training must not start a round the others never join
        trainer.should_stop = True

    def _join_start_if_skipped(self) -> None:
        """A fit with no steps left skips ``on_train_start`` (Lightning does not start its loop). Take
        part in the start agreement anyway, saying so, so that the other islands stop at once instead
        of waiting ``timeout_s`` for this island at their first round."""
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if (trainer is None or self._start_agreed or not self._anchors or self.num_islands == 1
                or trainer.state.fn != TrainerFn.FITTING or trainer.state.status != TrainerStatus.RUNNING):
            return
        try:
            self._agree_on_start(more=False)
        except Exception as err:  # noqa: BLE001 - this island is done either way; a lost partner is not its failure
            rank_zero_warn(f"islands: could not tell the other islands that island {self.island_index} has no "
                           f"steps left: {err}")

    # ------------------------------------------------------------------ checkpoints
    def _outer_dtensors(self, tensors: Sequence[Tensor]) -> dict[str, Tensor]:
        from torch.distributed.tensor import DTensor

        assert self.layout is not None
        out = {}
        for e, p, t in zip(self.layout.entries, self._params, tensors):
            if isinstance(p, DTensor):
                out[e.name] = DTensor.from_local(t.to(p.device), p.device_mesh, p.placements, run_check=False,
                                                 shape=p.shape, stride=p.stride())
            else:
                out[e.name] = t
        return out

    def _counters(self, round_tokens: float) -> dict[str, Any]:
        return {"round": self.round, "inner_steps": self.inner_steps, "round_steps": self.round_steps,
                "round_tokens": round_tokens, "total_tokens": self.total_tokens,
                "stepped_batch": self._stepped_batch, "totals": dict(self.totals),
                "steps_per_round": self.steps_per_round, "stopping": self._stopping,
                "outer_steps": self.outer_opt.steps, "has_momentum": bool(self.outer_opt.buffers)
                and all(b is not None for b in self.outer_opt.buffers), "has_residual": self.residual is not None,
                "island": self.island_index,
                "num_islands": self.num_islands,
                "fingerprint": self.fingerprint() if self.layout is not None else None}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # A checkpoint taken while validation has the global model swapped in must still hold the
        # island's local parameters (exact resume); the global ones travel in islands_outer/.
        if self._stash is None:
            return super().lightning_module_state_dict()
        self._swap_out_global()
        try:
            return super().lightning_module_state_dict()
        finally:
            self._swap_in_global()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if not self._anchors:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint import save as dcp_save

        checkpoint["islands"] = self._counters(self._island_sum(float(self.round_tokens)))
        with self._beating("saving checkpoint"):
            super().save_checkpoint(checkpoint, filepath, storage_options)
            path = Path(self.broadcast(str(filepath)))
            state: dict[str, Any] = {"anchor": self._outer_dtensors(self._anchors)}
            if checkpoint["islands"]["has_momentum"]:
                state["momentum"] = self._outer_dtensors(self.outer_opt.buffers)  # type: ignore[arg-type]
            if self.residual is not None:
                state["residual"] = self._outer_dtensors(self.residual)
            dcp_save(state, storage_writer=FileSystemWriter(path / _OUTER_DIR, overwrite=True))
            self.barrier()

    def _load_outer(self, path: Path, like: Sequence[Tensor], momentum: bool, residual: bool = False) -> dict[str, Any]:
        from torch.distributed.checkpoint import load as dcp_load

        state: dict[str, Any] = {"anchor": self._outer_dtensors([t.detach().float().clone() for t in like])}
        for key, wanted in (("momentum", momentum), ("residual", residual)):
            if wanted:
                state[key] = self._outer_dtensors([torch.zeros_like(t, dtype=torch.float32) for t in like])
        dcp_load(state, checkpoint_id=path / _OUTER_DIR)
        return state

    def _load_leader_residual(self, path: Path) -> list[Tensor] | None:
        """This rank's shards of the whole residual that an older checkpoint's leader saved
        (``islands_error_feedback.pt``), or None if it holds none."""
        assert self.layout is not None
        found = self.broadcast((path / _EF_FILE).exists() if self.is_leader else False)
        if not found:
            return None
        full = torch.load(path / _EF_FILE, map_location="cpu", weights_only=True)["residual"]
        if full is None:
            return None
        if full.numel() != self.layout.numel:
            raise ValueError(f"{path / _EF_FILE} holds a residual of {full.numel()} values but the model has "
                             f"{self.layout.numel}; resume with the model that saved it")
        return [self.layout.shard_of(full.reshape(-1), i, p).to(a.device).clone()
                for i, (p, a) in enumerate(zip(self._params, self._anchors))]

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        meta = checkpoint.get("islands")
        path = Path(self.broadcast(str(checkpoint_path)))
        if not self._anchors:
            # Not fitting (validate/test/predict from a checkpoint): evaluate the global model.
            if meta is not None:
                module = self.lightning_module
                assert module is not None
                named = list(module.named_parameters())
                self._params = [p for _, p in named]
                self.layout = CanonicalLayout(named)
                state = self._load_outer(path, [local_view(p) for p in self._params], False)
                reshard_all(module)
                with torch.no_grad():
                    for e, p in zip(self.layout.entries, self._params):
                        local_view(p).copy_(local_view(state["anchor"][e.name]))
                self._params, self.layout = [], None
            return checkpoint
        if meta is None:
            # A plain (e.g. FSDP) checkpoint: every island starts again from island 0's loaded state.
            self._anchors = []
            self._adopt_island0_state()
            return checkpoint
        if meta["island"] != self.island_index or meta.get("num_islands", self.num_islands) != self.num_islands:
            raise ValueError(
                f"{path} was saved by island {meta['island']} of {meta.get('num_islands')}, but this is island "
                f"{self.island_index} of {self.num_islands}; give each island its own checkpoint (resume=[...])"
            )
        has_residual = bool(meta.get("has_residual")) and self.use_error_feedback
        state = self._load_outer(path, self._anchors, meta["has_momentum"], has_residual)
        assert self.layout is not None
        for a, e in zip(self._anchors, self.layout.entries):
            a.copy_(local_view(state["anchor"][e.name]))
        if meta["has_momentum"]:
            self.outer_opt.buffers = [local_view(state["momentum"][e.name]).to(a.device).clone()
                                      for e, a in zip(self.layout.entries, self._anchors)]
        self.outer_opt.steps = meta["outer_steps"]
        self.residual = None
        if has_residual:
            self.residual = [local_view(state["residual"][e.name]).to(a.device).clone()
                             for e, a in zip(self.layout.entries, self._anchors)]
        elif self.use_error_feedback:
            self.residual = self._load_leader_residual(path)
        self.round, self.inner_steps, self.round_steps = meta["round"], meta["inner_steps"], meta["round_steps"]
        self.round_tokens = int(meta["round_tokens"]) if self.is_leader else 0
        self.total_tokens = meta["total_tokens"]
        self._stepped_batch = meta["stepped_batch"]
        self._stopping = bool(meta.get("stopping", False))
        self.steps_per_round = int(meta.get("steps_per_round", self.steps_per_round))
        self.totals = dict(meta["totals"])
        return checkpoint

    @override
    def teardown(self) -> None:
        if self.link is not None:
            self._join_start_if_skipped()
            self.link.close()
            self.link = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        pass


def register() -> None:
    """Make ``Trainer(strategy="islands")`` resolve to :class:`IslandStrategy`."""
    if "islands" not in StrategyRegistry:
        StrategyRegistry.register("islands", IslandStrategy, description="DiLoCo across islands, FSDP2 inside")
