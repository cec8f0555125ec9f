"""IslandStrategy: FSDP2 inside an island, DiLoCo outer steps across islands (Lightning glue only).

The round itself lives in :mod:`lightning_islands.engine` (no Lightning there). This file decides
*when* the engine runs in Lightning's life cycle and what a checkpoint holds:

- ``setup``: shard the module, then meet the other islands (fingerprint check, initial parameters
  from island 0, anchors taken from them before any inner step);
- ``optimizer_step``: marks that the current batch stepped; the batch is closed at the next
  boundary (next batch, validation, end of training) and reported to the
  :class:`~lightning_islands.engine.RoundDriver`, which lands and runs the rounds;
- ``on_validation_start``/``end``: validation sees the global parameters;
- ``save_checkpoint``/``load_checkpoint``: the outer state travels with the checkpoint.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from typing_extensions import override

from lightning_islands.batches import batch_weight
from lightning_islands.engine import CanonicalLayout, IslandEngine, IslandSettings, RoundDriver, TorchGroup
from lightning_islands.engine.checkpoint import OUTER_DIR, load_global_parameters
from lightning_islands.engine.island import Island
from lightning_islands.engine.rendezvous import RUN_RECORD, checkpoint_to_load
from lightning_islands.engine.safe_metadata import check_metadata
from lightning_islands.engine.saves import (
    clear_staged,
    disk_full,
    explain_unreadable,
    explain_unwritable,
    is_round_folder,
    previous_path,
    publish,
    staged_path,
)
from lightning_islands.fsdp import FSDP2Strategy
from lightning_islands.fsdp_policy import local_view, reshard_all
from lightning_islands.link.auth import SCHEME, AuthenticatedLink, AuthenticatedRankLink, load_secret
from lightning_islands.link.coordinator import island_identity, joining_from_env, restart_count
from lightning_islands.link.island_link import DEFAULT_GRACE_S, IslandLink
from lightning_islands.link.protocol import CoordinatorLost, IslandAborted
from lightning_islands.link.rank_lanes import RankLanes

T = TypeVar("T")


class IslandStrategy(FSDP2Strategy):
    """Train one model on several islands: FSDP2 inside each, DiLoCo outer steps between them.

    Each island is its own torch.distributed world (torchrun, SLURM, ...). Every ``sync_every``
    inner steps each island computes its pseudo-gradient ``anchor - params``, quantizes it with
    ``codec``, all islands exchange the payloads through the coordinator's lanes, and every island
    merges them (weighted by the tokens each island processed in the round, in island order) and
    takes an outer SGD step on the anchor, which then becomes the island's parameters. Global state
    is bit-identical on all islands after every outer step.

    Args:
        settings: how the islands train together (:class:`~lightning_islands.engine.IslandSettings`,
            every field documented there and in docs/SETTINGS.md); default ``IslandSettings()``.
        island, num_islands, coordinator, run_id: this island's identity; default from the
            environment (``LI_ISLAND``, ``LI_NUM_ISLANDS``, ``LI_COORDINATOR``, ``LI_RUN_ID``).
        join: this island joins a run under way (default: ``LI_JOIN=1``): with an index no island of
            the run has, it adopts the run's settings (all but its own ``steps_per_round``,
            ``outer_device`` and ``on_end``) and, at the round that takes it in, the global state.
        secret_file: a file holding the islands' shared secret (mode 600); default ``LI_SECRET_FILE``,
            else ``LI_SECRET``, else none. With a secret, every payload and round header carries an
            HMAC (:class:`~lightning_islands.link.auth.AuthenticatedLink`, see SECURITY.md).
        unit_classes, reshard_after_forward, process_group_backend, tensor_parallel_size,
            expert_parallel_size: as :class:`FSDP2Strategy`; islands may parallelize differently
            (they meet in the canonical layout, whatever their DTensor placements).
        **values: settings by name, replacing those of ``settings`` (``IslandStrategy(sync_every=100,
            codec="int2")``); a name that is not a setting is a TypeError naming it.
    """

    strategy_name = "islands"

    def __init__(self, settings: IslandSettings | None = None, *, island: int | None = None,
                 num_islands: int | None = None, coordinator: str | None = None, run_id: str | None = None,
                 join: bool | None = None, secret_file: str | None = None, unit_classes: Sequence[str] | None = None,
                 reshard_after_forward: bool = True, process_group_backend: str | None = None,
                 tensor_parallel_size: int = 1, expert_parallel_size: int = 1, **values: Any) -> None:
        self.settings = IslandSettings.with_values(settings, values, "IslandStrategy")
        deadline_s = self.settings.deadline_s
        super().__init__(
            unit_classes=unit_classes, reshard_after_forward=reshard_after_forward, save_distributed_checkpoint=True,
            process_group_backend=process_group_backend, tensor_parallel_size=tensor_parallel_size,
            expert_parallel_size=expert_parallel_size,
            # the leader may wait up to deadline_s for other islands while the other ranks wait for it
            timeout=max(default_pg_timeout, timedelta(seconds=2 * deadline_s)))
        self.join = joining_from_env(join)
        self.island_index, self.num_islands, self.coordinator, self.run_id = island_identity(
            island, num_islands, coordinator, run_id, self.join)
        self.secret_file = secret_file
        self.engine: IslandEngine | None = None  # from setup on (it needs the sharded module)
        self.driver: RoundDriver | None = None  # lands and runs the engine's rounds, from setup on
        self.round_callbacks: list[Callable[[IslandStrategy], None]] = []
        self._params: list[Tensor] = []
        self._stash: list[Tensor] | None = None
        self._stepped_batch = False
        self._val_started: float | None = None
        self._last_status = 0.0
        self._beats = 0
        self._start_agreed = False  # this fit took part in the islands' start agreement
        self._resuming = False
        self._resume_from: bool | str = False  # what the fit resumes from, as the islands compare it
        self._rejoining = False  # a restarted island: the live islands take it back at its first round
        self._secret: bytes | None = None
        self._link: IslandLink | AuthenticatedLink | None = None  # a joiner's, opened before its engine
        self._tp_rank: int | None = None  # this rank's place in its tensor-parallel group

    # ------------------------------------------------------------------ what the app reads
    @property
    def round(self) -> int:
        """Outer rounds completed."""
        return self.engine.schedule.round if self.engine else 0

    @property
    def total_tokens(self) -> int:
        """Tokens this island merged into the global model."""
        return self.engine.schedule.total_tokens if self.engine else 0

    @property
    def totals(self) -> dict[str, float]:
        """Bytes and seconds of the link so far (``bytes_sent``, ``seconds_waiting``, ...)."""
        return self.engine.totals if self.engine else {}

    @property
    def last_round_metrics(self) -> dict[str, float]:
        """The ``islands/`` metrics of the last round."""
        return self.engine.last_round_metrics if self.engine else {}

    def _ready(self) -> bool:
        return self.engine is not None and self.engine.state.ready

    @torch.no_grad()
    def _locals(self) -> list[Tensor]:
        reshard_all(self.lightning_module)  # type: ignore[arg-type]
        return [local_view(p) for p in self._params]

    def _exchange_device(self) -> torch.device:
        """Where the leader runs the round's exchange (encode, decode, merge): ``outer_device`` if
        set, else the training device (on a GPU the codecs run their Triton kernels there and only
        payloads cross to the host). The leader then holds about ``6 + islands`` chunk-sized
        temporaries there (``exchange_chunk_mib`` each) on top of its shards; lower the chunk if
        that does not fit."""
        if self.settings.outer_device:
            return torch.device(self.settings.outer_device)
        return self.root_device

    # ------------------------------------------------------------------ rendezvous
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._start_agreed = False
            self._resuming = trainer.ckpt_path is not None
            # islands resuming from their round checkpoints agree on a round before loading: all or none do
            self._resume_from = "round checkpoints" if self._resuming and is_round_folder(
                Path(str(trainer.ckpt_path))) else self._resuming
            self._rendezvous()

    def _rendezvous(self) -> None:
        module = self.lightning_module
        assert module is not None
        if self.settings.expert_weighting and not callable(getattr(module, "island_token_counts", None)):
            raise TypeError(
                f"expert_weighting=True needs the module to implement island_token_counts() and "
                f"reset_island_token_counts(); {type(module).__name__} does not (or set expert_weighting=False)")
        named = list(module.named_parameters())
        self._params = [p for _, p in named]
        if self.join and self.engine is None:  # the run's settings, before anything is built from them
            self._secret = load_secret(self.secret_file)
            self.settings = self._adopt_run_settings()
        layout = CanonicalLayout.from_parameters(named, TorchGroup(self.root_device, timeout=self._timeout))
        previous, self.engine = self.engine, IslandEngine(self.settings, layout, self.island_index, self.num_islands,
                                                          self.root_device, self._exchange_device())
        if previous is not None:  # a second fit with this strategy continues its rounds and outer state
            self.engine.continue_from(previous)
        self.driver = RoundDriver(self.engine, self._locals, experts=self._expert_counts, on_round=self._after_round,
                                  last=self._wants_stop)
        if self.num_islands > 1:
            self._secret = load_secret(self.secret_file)
            # whether payloads are signed must agree (never the secret itself, nor where it is kept)
            fingerprint = {**self.engine.fingerprint(self._resuming), "resuming": self._resume_from,
                           "auth": SCHEME if self._secret else False}
            # restarted after a crash, or new to a run under way: the live islands take it in
            self._rejoining = restart_count() > 0 or self.join
            self.engine.meet(self._open_link, fingerprint, rejoining=self._rejoining and not self.join,
                             joining=self.join, open_rank_link=self._open_rank_link)
        if self._rejoining:  # its own parameters stand in until the round that takes it back replaces them
            self.engine.state.set_anchors(self._locals())
        else:
            self.engine.adopt_initial_state(self._locals(), dict(module.named_buffers()))

    def _open_link(self) -> IslandLink | AuthenticatedLink:
        if self._link is not None:  # a joiner's, opened to read the run's settings
            link, self._link = self._link, None
            return link
        assert self.coordinator is not None
        s = self.settings

        def grace_s() -> float:
            return self.engine.grace_s() if self.engine is not None else DEFAULT_GRACE_S

        def slow_wait_s() -> float | None:  # read when asked: a joiner adopts the run's settings later
            now = self.settings
            if not now.max_staleness:
                return None
            return grace_s() if now.staleness_wait_s is None else now.staleness_wait_s

        link = IslandLink(self.coordinator, self.island_index, self.num_islands, run_id=self.run_id, lanes=s.lanes,
                          deadline=timedelta(seconds=s.deadline_s), min_islands=s.min_islands,
                          grace_s=grace_s, secret=self._secret, join=self.join,
                          slow_wait_s=slow_wait_s, rejoin_every=lambda: self.settings.rejoin_every)
        return AuthenticatedLink(link, self._secret, self.run_id) if self._secret else link

    def _open_rank_link(self) -> RankLanes | AuthenticatedRankLink:
        """This rank's own lanes to the same rank of the other islands (``exchange=sliced``); with a
        secret, its payloads carry MACs as the leader's do."""
        assert self.coordinator is not None and self.engine is not None
        s, rank = self.settings, self.engine.group.rank
        lanes = RankLanes(self.coordinator, self.island_index, rank, self.num_islands, run_id=self.run_id,
                          lanes=s.lanes, deadline=timedelta(seconds=s.deadline_s), grace_s=self.engine.grace_s)
        return AuthenticatedRankLink(lanes, self._secret, self.run_id, rank) if self._secret else lanes

    def _adopt_run_settings(self) -> IslandSettings:
        """A joiner (every rank): the run's settings from its record at the coordinator, with this
        island's own per-island settings; what differed from its own is logged."""
        def leader() -> dict[str, Any]:
            self._link = self._open_link()
            record = self._link.read_object(RUN_RECORD, self.settings.deadline_s)
            return record["settings"]  # type: ignore[index]

        published = self._island().agree(leader)
        adopted = self.settings.adopt(published)
        changed = {k: getattr(adopted, k) for k in IslandSettings.names() if getattr(adopted, k) != getattr(
            self.settings, k)}
        rank_zero_info(f"islands: island {self.island_index} joins run {self.run_id!r} with its settings"
                       + (f" (changed here: {changed})" if changed else ""))
        return adopted

    # ------------------------------------------------------------------ inner steps and rounds
    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._stepped_batch = True
        if self._ready() and self.engine.schedule.next_step_ends_last_round():  # type: ignore[union-attr]
            # The round runs when the next batch starts, and Lightning trains a batch it has started:
            # stop after this one instead, and on_train_end runs the round (no unmerged extra step).
            self.lightning_module.trainer.should_stop = True  # type: ignore[union-attr]
        return out

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._close_batch()
        super().on_train_batch_start(batch, batch_idx)
        if self._ready() and self._counts_tokens():
            self.engine.count_tokens(batch_weight(self.lightning_module, batch))  # type: ignore[union-attr,arg-type]
        self._publish_status()

    def _counts_tokens(self) -> bool:
        """Whether this rank's batches count for the island: one rank of each tensor-parallel group
        (its ranks all see the same batch)."""
        if self._tp_rank is None:
            self._tp_rank = self.device_mesh["tensor_parallel"].get_local_rank() if self.parallel_sizes["tp"] > 1 else 0
        return self._tp_rank == 0

    def _close_batch(self) -> None:
        if not self._stepped_batch or not self._ready():
            return
        self._stepped_batch = False
        self.driver.step_closed()  # type: ignore[union-attr]

    def _wants_stop(self) -> bool:
        """Whether the round about to start is this island's last: it is ending training
        (``max_steps`` reached, or a callback asked the trainer to stop) or ``max_rounds`` is
        reached. Any island's last round is everyone's."""
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        if trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step:
            return True
        return self.engine.schedule.in_last_round()  # type: ignore[union-attr]

    def outer_step(self, final: bool = False) -> dict[str, float]:
        """Run one round's exchange and outer step now (every rank of every island must call it).

        ``final``: this island is ending training (its last, possibly partial or empty, round); the
        others learn it through the round header and stop after this round too. The round in
        flight, if any, lands first; an overlapped round only starts here (no metrics then: they
        are logged when it lands).
        """
        assert self.driver is not None
        return self.driver.run_round(final)

    def _after_round(self, metrics: dict[str, float], stop: bool) -> None:
        """A round ended (landed or run): stop with the islands, log its metrics, run the callbacks."""
        if stop:
            self.lightning_module.trainer.should_stop = True  # type: ignore[union-attr]
        if metrics:
            self._log(metrics)
            for callback in self.round_callbacks:
                callback(self)

    def _expert_counts(self) -> dict[str, list[float]] | None:
        """This island's tokens per expert in the round, per expert parameter (island collective)."""
        module, engine = self.lightning_module, self.engine
        if not self.settings.expert_weighting or module is None or engine is None:
            return None
        counts = module.island_token_counts()  # type: ignore[operator]
        if not self._counts_tokens():  # the same tokens as its tensor-parallel group's first rank
            counts = {k: torch.zeros_like(v) for k, v in counts.items()}
        summed = engine.island_expert_counts(counts)
        if summed:
            module.reset_island_token_counts()  # type: ignore[operator]
        return summed

    def _log(self, metrics: dict[str, float]) -> None:
        """The round's ``islands/*`` metrics to the loggers (rank 0) and to ``trainer.callback_metrics``
        (every rank), where callbacks such as ``ModelCheckpoint(monitor=...)`` read them."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return
        trainer.callback_metrics.update({k: torch.tensor(float(v)) for k, v in metrics.items()})
        if self.global_rank == 0:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _publish_status(self) -> None:
        link = self.engine.link if self.engine else None
        now = time.monotonic()
        if link is None or self.global_rank != 0 or now - self._last_status < 0.5:
            return
        self._last_status = now
        self._beats += 1
        with suppress(Exception):  # "beat" changes every time: islands waiting for this one keep waiting
            link.heartbeat({**self._status(), "beat": self._beats})

    def _status(self) -> dict[str, Any]:
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        loss = trainer.callback_metrics.get("train/loss")
        eta = self.engine.schedule.seconds_to_round(time.perf_counter()) if self.engine else None
        heading = self.engine.heading_round if self.engine else 0
        return {"step": trainer.global_step, "round": heading, "loss": float(loss) if loss is not None else None,
                "bytes": self.totals.get("bytes_sent", 0.0) + self.totals.get("bytes_received", 0.0),
                **({"eta_s": round(eta, 2)} if eta is not None else {})}

    def _beating(self, phase: str) -> AbstractContextManager[None]:
        """The leader keeps beating while a long step without training steps runs (a checkpoint
        write): waiting islands see ``phase`` in its status and do not give it up as silent."""
        link = self.engine.link if self.engine else None
        if link is None or not self.global_rank == 0:
            return nullcontext()
        return link.beating({**self._status(), "phase": phase})

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._publish_status()  # a long validation is progress too
        return super().validation_step(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        link = self.engine.link if self.engine else None
        if link is not None and self.global_rank == 0 and not isinstance(exception, (IslandAborted, CoordinatorLost)):
            with suppress(Exception):
                link.abort(f"island {self.island_index}: {type(exception).__name__}: {exception}")
        super().on_exception(exception)

    # ------------------------------------------------------------------ global model views
    def _swap_in_global(self) -> None:
        if not self._ready() or self.engine.schedule.round_steps == 0 and not self._stepped_batch:  # type: ignore
            return
        locals_ = self._locals()
        self._stash = [t.detach().clone() for t in locals_]
        self.engine.state.write_to(locals_)  # type: ignore[union-attr]

    def _swap_out_global(self) -> None:
        if self._stash is None:
            return
        with torch.no_grad():
            for loc, s in zip(self._locals(), self._stash):
                loc.copy_(s)
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
        if self._val_started is not None and self.engine is not None:
            self.engine.schedule.exclude(time.perf_counter() - self._val_started)
        self._val_started = None
        self._swap_out_global()
        super().on_validation_end()

    @override
    def on_train_end(self) -> None:
        if self._ready():
            self._close_batch()
            # Unless the islands agreed to stop, this island's last (possibly partial or empty) round
            # tells the others to stop after it, so nobody waits for a missing round.
            if self.driver.end():  # type: ignore[union-attr]
                # Steps after the agreed last round are not merged anywhere: end on the global model.
                self._swap_in_global()
                self._stash = None
        super().on_train_end()

    def global_parameters(self) -> dict[str, Tensor]:
        """The full global parameters (fp32, on CPU) by name on the island's leader (empty on the
        other ranks); a collective of the island."""
        assert self.engine is not None
        return self.engine.global_parameters()

    def global_state_digest(self) -> str | None:
        """SHA-256 of the global parameters and outer momentum on the leader; a collective of the island."""
        assert self.engine is not None
        return self.engine.global_state_digest()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if not self._ready():
            return
        # Validation seconds counted so far (the sanity check) happened before this round started.
        self.engine.schedule.restart_clock(untimed_first_step=True)  # type: ignore[union-attr]
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        more = trainer.max_steps < 0 or trainer.global_step < trainer.max_steps
        self._start_agreed = True
        if self._rejoining:  # the live islands' state, outer state and round, through the round that takes it back
            self._after_round(*self.engine.rejoin(self._locals()))  # type: ignore[union-attr]
            return
        stop, message, warn = self.engine.settle_start(self.engine.agree_on_start(more))  # type: ignore[union-attr]
        if message:
            (rank_zero_warn if warn else rank_zero_info)(message)
        trainer.should_stop = trainer.should_stop or stop

    def _join_start_if_skipped(self) -> None:
        """A fit with no steps left skips ``on_train_start``: take part in the start agreement anyway,
        saying so, so that the other islands stop at once instead of waiting ``deadline_s``."""
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if (trainer is None or self._start_agreed or not self._ready() or self.num_islands == 1
                or trainer.state.fn != TrainerFn.FITTING or trainer.state.status != TrainerStatus.RUNNING):
            return
        try:
            self.engine.agree_on_start(more=False)  # type: ignore[union-attr]
        except Exception as err:  # noqa: BLE001 - this island is done either way; a lost partner is not its failure
            rank_zero_warn(f"islands: could not tell the other islands that island {self.island_index} has no "
                           f"steps left: {err}")

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # A checkpoint holds no round in flight: it lands first (every rank dumps the checkpoint).
        if self._ready() and self.engine.in_flight is not None:  # type: ignore[union-attr]
            validating = self._stash is not None
            self._swap_out_global()
            self.driver.land()  # type: ignore[union-attr]
            if validating:
                self._swap_in_global()
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
        if not self._ready():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        assert self.engine is not None
        checkpoint["islands"] = {**self.engine.checkpoint_meta(self._resuming), "stepped_batch": self._stepped_batch}
        final = Path(self.broadcast(str(filepath)))
        staged = staged_path(final)
        self.on_rank_zero(lambda: clear_staged(final))  # what an interrupted write left
        with self._beating("saving checkpoint"):  # written aside, then moved into place: a crash keeps the last one
            # each stage ends with every rank knowing whether all wrote their part: none waits in the next
            failures = self._on_every_rank(lambda: FSDP2Strategy.save_checkpoint(self, checkpoint, staged,
                                                                                 storage_options))
            if not failures:
                failures = self._on_every_rank(lambda: self.engine.save_checkpoint(staged, self._params))  # type: ignore
            if failures:  # ENOSPC, a failed shard: nothing published, the partial write removed
                kept = self.on_rank_zero(lambda: (clear_staged(final), sorted(final.parent.glob("*.ckpt")))[1])
                rank, (full, text) = failures[0]
                cause = OSError(errno.ENOSPC, f"rank {rank}: {text}") if full else RuntimeError(f"rank {rank}: {text}")
                raise RuntimeError(explain_unwritable(final, cause, kept))
            self.on_rank_zero(lambda: publish(staged, final))

    def on_rank_zero(self, work: Callable[[], T]) -> T:
        """Run ``work`` (steps on the island's files) on rank 0; every rank of the island gets its
        result, or its error, so that no rank waits in a collective for one that failed
        (:meth:`~lightning_islands.engine.island.Island.agree`)."""
        return self._island().agree(work)

    def _island(self) -> Island:
        """This rank's island (the engine's, or, before one exists, one over this island's ranks)."""
        if self.engine is not None:
            return self.engine.side
        return Island(self.island_index, self.num_islands, TorchGroup(self.root_device))

    def _on_every_rank(self, work: Callable[[], Any]) -> list[tuple[int, tuple[bool, str]]]:
        """Run ``work`` on every rank; returns, on every rank, each failed rank with whether its
        disk was full and its error (empty: all succeeded)."""
        mine: tuple[bool, str] | None = None
        try:
            work()
        except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
            mine = (disk_full(err), f"{type(err).__name__}: {str(err)[:500]}")
        everyone: list[Any] = [mine]
        if self.world_size > 1:
            everyone = [None] * self.world_size
            torch.distributed.all_gather_object(everyone, mine)
        return [(rank, failure) for rank, failure in enumerate(everyone) if failure is not None]

    def land(self) -> None:
        """Land the round in flight now, if any (every rank of the island): a checkpoint taken next
        then holds whole rounds (:class:`~lightning_islands.callbacks.RoundCheckpoint`)."""
        if self._ready() and self._stash is None:
            self.driver.land()  # type: ignore[union-attr]

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = self._checkpoint_to_load(Path(self.broadcast(str(checkpoint_path))))
        try:
            for folder in (path, path / OUTER_DIR):  # pickled metadata: refused if it could run code
                check_metadata(folder)
            checkpoint = super().load_checkpoint(path, weights_only=True if weights_only is None else weights_only)
        except (Exception, CheckpointException) as err:  # a BaseException in torch: named with the fix
            if isinstance(err, FileNotFoundError) and not previous_path(path).exists():
                raise
            raise RuntimeError(explain_unreadable(path, err)) from err
        meta = checkpoint.get("islands")
        module, engine = self.lightning_module, self.engine
        assert module is not None
        if not self._ready():
            if meta is not None:  # not fitting (validate/test/predict from a checkpoint): the global model
                named = list(module.named_parameters())
                self._params = [p for _, p in named]
                layout = CanonicalLayout.from_parameters(named, TorchGroup(self.root_device))
                load_global_parameters(path, self._params, self._locals(), layout)
                self._params = []
            return checkpoint
        assert engine is not None
        if meta is None:  # a plain (e.g. FSDP) checkpoint: every island starts again from island 0's state
            engine.adopt_initial_state(self._locals(), dict(module.named_buffers()))
            return checkpoint
        engine.load_checkpoint(path, meta, self._params)
        self._stepped_batch = meta["stepped_batch"]
        return checkpoint

    def _checkpoint_to_load(self, path: Path) -> Path:
        """The checkpoint ``path`` names, repaired; for a folder of round checkpoints, the round
        the islands agree on (:func:`~lightning_islands.engine.rendezvous.checkpoint_to_load`)."""
        agree = self._ready() and self.num_islands > 1 and not self._rejoining  # a rejoiner takes its latest
        path, message = checkpoint_to_load(self._island(), path, agree)
        if message:
            rank_zero_info(message)
        return path

    @override
    def teardown(self) -> None:
        if self.engine is not None:
            self._join_start_if_skipped()  # a collective of the island: every rank takes part
            if self.engine.link is not None:
                self.engine.link.close()
                self.engine.link = None
            if self.engine.rank_link is not None:
                self.engine.rank_link.close()
                self.engine.rank_link = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        pass


def register() -> None:
    """Make ``Trainer(strategy="islands")`` resolve to :class:`IslandStrategy`."""
    if "islands" not in StrategyRegistry:
        StrategyRegistry.register("islands", IslandStrategy, description="DiLoCo across islands, FSDP2 inside")


register()  # importing this module makes the name resolve (lightning_islands/__init__.py)
