"""One training process of one island: ``python -m lightning_islands.app.worker JOB.yaml``.

The Hydra app composes and resolves the job, writes it to ``JOB.yaml`` and launches this module
with torch.distributed.run once per island; the launcher sets ``LI_ISLAND`` and friends. Here the
config becomes a model, a datamodule, a strategy, loggers and a Trainer, and rank 0 of each island
writes ``island{i}/result.json`` for the summary.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_islands.startup import startup_imports

# torch, Lightning and Hydra: a fifth less CPU at start (see lightning_islands.startup)
with startup_imports(main=__name__ == "__main__"):
    import lightning.pytorch as pl
    import torch
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import ModelCheckpoint
    from omegaconf import DictConfig, OmegaConf

    from lightning_islands.app.components import build_callbacks, build_loggers, fill_placeholders, trainer_options
    from lightning_islands.app.gpus import ENV_ACCELERATOR
    from lightning_islands.app.history import History
    from lightning_islands.app.launch import ENV_PROGRESS
    from lightning_islands.app.settings import engine_settings
    from lightning_islands.app.step_delay import StepDelays, parse_step_delays
    from lightning_islands.callbacks import RoundCheckpoint
    from lightning_islands.engine.saves import holder, round_checkpoints
    from lightning_islands.fsdp import FSDP2Strategy, destroy_world_at_exit
    from lightning_islands.link.coordinator import ENV_ISLAND, ENV_NUM_ISLANDS, restart_count
    from lightning_islands.strategy import IslandStrategy


def island_identity() -> tuple[int, int]:
    """(island index, number of islands) from the launcher's environment, ``(0, 1)`` without one."""
    return int(os.environ.get(ENV_ISLAND, "0")), int(os.environ.get(ENV_NUM_ISLANDS, "1"))


def island_member(cfg: DictConfig, island: int) -> dict[str, Any]:
    """This island's entry of ``islands.members`` (devices, batch size, overrides)."""
    if cfg.strategy.name != "islands":
        keys = ("tensor_parallel_size", "expert_parallel_size")
        return {"devices": int(cfg.strategy.get("devices", 1)), **{k: int(cfg.strategy[k]) for k in keys
                                                                     if cfg.strategy.get(k)}}
    members = cfg.islands.members
    if island >= len(members):
        raise ValueError(f"island {island} has no entry in islands.members (only {len(members)} given)")
    return OmegaConf.to_container(members[island], resolve=True)  # type: ignore[return-value]


def build_strategy(cfg: DictConfig, island: int, member: dict[str, Any]) -> Any:
    """The Lightning strategy object (or name) for ``cfg.strategy``."""
    name = cfg.strategy.name
    if name == "single":
        return "auto"
    if name == "ddp":
        return "ddp"
    parallel = {"tensor_parallel_size": int(member.get("tensor_parallel_size") or 1),
                "expert_parallel_size": int(member.get("expert_parallel_size") or 1)}
    if name == "fsdp":
        return FSDP2Strategy(unit_classes=cfg.strategy.get("unit_classes"),
                             reshard_after_forward=cfg.strategy.get("reshard_after_forward", True), **parallel)
    if name == "islands":
        settings = engine_settings(cfg.islands, steps_per_round=member.get("steps_per_round"))
        return IslandStrategy(settings, secret_file=cfg.islands.get("secret_file"),
                              unit_classes=cfg.strategy.get("unit_classes"),
                              reshard_after_forward=cfg.strategy.get("reshard_after_forward", True), **parallel)
    raise ValueError(f"unknown strategy {name!r}; choose single, ddp, fsdp or islands")


def resume_path(resume: Any, island: int, num_islands: int, strategy: str) -> str | None:
    """This island's checkpoint from ``resume``: a list (one per island), a path containing
    ``{island}``, or (other strategies, or a plain FSDP checkpoint every island starts from) one path."""
    if resume is None:
        return None
    if isinstance(resume, str):
        if "{island}" in resume:
            return resume.format(island=island)
        rounds = Path(resume, f"island{island}", "checkpoints")
        if strategy == "islands" and num_islands > 1 and rounds.is_dir():  # a run's folder
            if not round_checkpoints(rounds, repair=False):
                raise ValueError(f"resume={resume} is a run folder, but {rounds} holds no round checkpoints; resume "
                                 "from given checkpoints (resume='[...]'), and let runs write round checkpoints "
                                 "(trainer.checkpoint_every_n_rounds) to resume them by folder")
            return str(rounds)  # the last round every island has a checkpoint of
        if strategy == "islands" and num_islands > 1 and Path(resume, "meta.pt").exists():
            try:  # tensors and plain data only: a load that could run code is refused
                meta = torch.load(Path(resume, "meta.pt"), weights_only=True)
            except pickle.UnpicklingError as err:
                raise ValueError(f"resume={resume}: {Path(resume, 'meta.pt')} holds more than tensors and plain "
                                 f"data, and loading it could run code; resume from a checkpoint Lightning wrote "
                                 f"({str(err).splitlines()[0]})") from err
            if "islands" in meta:
                raise ValueError(
                    f"resume={resume} is one island's checkpoint; give one per island: "
                    "resume='[path/island0/...,path/island1/...]' or a path with {island} in it"
                )
        return resume
    paths = list(resume)
    if len(paths) != num_islands:
        raise ValueError(f"resume lists {len(paths)} checkpoints for {num_islands} islands; give one per island")
    return str(paths[island])


def restart_checkpoint(ckpt_dir: Path) -> str | None:
    """A restarted island (``islands.max_restarts``) resumes from its own latest checkpoint, if it
    wrote one (its inner optimizer, learning-rate schedule and data position): ``last.ckpt`` or its
    latest round checkpoint, whichever is newer. The round that takes it back replaces its global
    state with the live islands'. ``None``: a first start, or none yet."""
    if restart_count() == 0:
        return None
    last = ckpt_dir / "last.ckpt"
    held = holder(last)  # also where a save cut short left it
    rounds = [holder(p) for p in round_checkpoints(ckpt_dir, repair=False).values()]
    newest_round = max((p.stat().st_mtime for p in rounds if p is not None), default=None)
    if newest_round is not None and (held is None or newest_round >= held.stat().st_mtime):
        return str(ckpt_dir)  # a folder of round checkpoints: the strategy takes the latest
    return str(last) if held is not None else None


class StepDelay(pl.Callback):
    """Emulates a slower island: sleeps after every training batch as ``delays`` says for that step
    (a constant, or a schedule: :mod:`lightning_islands.app.step_delay`)."""

    def __init__(self, delays: StepDelays, sleep: Callable[[float], None] = time.sleep) -> None:
        self.delays, self.sleep = delays, sleep

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.sleep(self.delays.at(max(trainer.global_step - 1, 0)))


class StepTimer(pl.Callback):
    """Wall time of every training batch (start to start), for steady-state step times, and of the
    training loop (first batch start to last batch end: no setup, no work after the last step)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.last_end: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter())

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.last_end = time.perf_counter()

    def loop_seconds(self) -> float | None:
        """Seconds from the first batch's start to the last batch's end (None: no batch ran)."""
        return self.last_end - self.times[0] if self.times and self.last_end is not None else None

    def median_step_seconds(self, skip: int = 10) -> float | None:
        """Median of the batch-to-batch intervals after the first ``skip`` batches."""
        gaps = sorted(b - a for a, b in zip(self.times[skip:], self.times[skip + 1 :]))
        return gaps[len(gaps) // 2] if gaps else None


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train this process's part of the job; returns (and on rank 0 writes) the island's result."""
    island, num_islands = island_identity()
    run_dir = Path(cfg.run_dir)
    fill_placeholders(island, run_dir)  # before anything of the job is read: ${li:...} anywhere resolves
    member = island_member(cfg, island)
    # Every island builds the same initial model (so no island has to broadcast its weights at the
    # start), then continues with its own random stream.
    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    model = instantiate(cfg.model)
    if island:
        pl.seed_everything(int(cfg.seed) + island, workers=True, verbose=False)
    data_kwargs: dict[str, Any] = {}
    if member.get("batch_size") is not None:
        data_kwargs["batch_size"] = member["batch_size"]
    datamodule = instantiate(cfg.data, **data_kwargs)
    strategy = build_strategy(cfg, island, member)
    t = cfg.trainer
    trainer_kwargs = trainer_options(t)
    if member.get("precision") is not None:
        trainer_kwargs["precision"] = member["precision"]
    if member.get("accelerator") or str(trainer_kwargs.get("accelerator", "auto")) == "auto":
        # the island's own, else what the launcher gave it (app/gpus.py: GPUs of its own, or none)
        trainer_kwargs["accelerator"] = member.get("accelerator") or os.environ.get(ENV_ACCELERATOR, "auto")
    ckpt_dir = run_dir / f"island{island}" / "checkpoints"
    checkpoint = ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True, save_top_k=0,
                                 every_n_train_steps=int(t.get("checkpoint_every_n_steps", 0) or 0) or None)
    timer = StepTimer()
    callbacks: list[pl.Callback] = [checkpoint, timer]
    every_rounds = int(t.get("checkpoint_every_n_rounds", 0) or 0)
    if every_rounds and cfg.strategy.name == "islands":  # found by round: islands resume together
        callbacks.append(RoundCheckpoint(ckpt_dir, every_n_rounds=every_rounds,
                                         keep=int(t.get("keep_round_checkpoints", 2))))
    delays = parse_step_delays(member.get("step_delay_s") or 0.0, f"islands.members[{island}].step_delay_s")
    if delays.active:
        callbacks.append(StepDelay(delays))
    tp = int(member.get("tensor_parallel_size") or 1)  # tensor-parallel ranks read the same batch
    history = History(run_dir / f"island{island}" / "history.jsonl", island, tokens_per_step=0.0)
    callbacks.append(history)
    loggers = build_loggers(cfg, run_dir, island)
    callbacks.extend(build_callbacks(cfg))
    trainer_kwargs.setdefault("enable_progress_bar", os.environ.get(ENV_PROGRESS, "1") != "0")
    trainer_kwargs.setdefault("enable_model_summary", False)
    trainer = pl.Trainer(devices=int(member.get("devices", 1)), num_nodes=1, strategy=strategy,
                         logger=loggers or False, callbacks=callbacks, use_distributed_sampler=False, **trainer_kwargs)
    history.tokens_per_step = (datamodule.batch_size * model.hparams.seq_len * trainer.world_size
                               * trainer.accumulate_grad_batches / tp)
    ckpt_path = restart_checkpoint(ckpt_dir) or resume_path(cfg.get("resume"), island, num_islands, cfg.strategy.name)
    # Lightning's own DDP leaves a gloo world to interpreter finalization, where its worker threads
    # can abort the process after a successful run; our strategies register this themselves.
    destroy_world_at_exit()
    started = time.time()
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    fit_seconds = time.time() - started
    # The model after the last outer step: global parameters (local == global once training ended).
    trainer.save_checkpoint(str(ckpt_dir / "final.ckpt"))
    metrics = trainer.validate(model, datamodule=datamodule, verbose=False)[0]
    result: dict[str, Any] = {
        "island": island, "num_islands": num_islands, "strategy": cfg.strategy.name,
        "world_size": trainer.world_size, "batch_size": datamodule.batch_size,
        "global_step": trainer.global_step, "fit_seconds": fit_seconds,
        # optimizer steps of this fit (global_step also counts those of a checkpoint resumed from)
        "fit_steps": len(timer.times) // max(1, trainer.accumulate_grad_batches),
        "step_seconds_median": timer.median_step_seconds(),
        "loop_seconds": timer.loop_seconds(),
        "val_loss": float(metrics["val/loss"]), "val_ppl": float(metrics["val/ppl"]),
        "tokens": int(trainer.global_step) * datamodule.batch_size * model.hparams.seq_len * trainer.world_size
        * trainer.accumulate_grad_batches,
        "checkpoint_dir": str(ckpt_dir), "log_dir": str(run_dir),
    }
    if isinstance(strategy, FSDP2Strategy):  # how the island laid the model over its processes
        result["mesh"] = strategy.parallel_sizes
        result["tokens"] = result["tokens"] // strategy.parallel_sizes["tp"]  # tensor-parallel ranks share batches
    if hasattr(model, "num_parameters"):
        result["parameters"] = model.num_parameters()
    if isinstance(strategy, IslandStrategy):
        result["tokens"] = strategy.total_tokens  # tokens merged into the global model
        result["rounds"] = strategy.round
        result["fragments"] = strategy.settings.fragments  # a round syncs one fragment of the model
        result["idle_fraction"] = strategy.totals["seconds_waiting"] / max(fit_seconds, 1e-9)
        last = {f"last_{k.split('/', 1)[1]}": v for k, v in strategy.last_round_metrics.items()}
        result["islands"] = {**last, **strategy.totals}
    if trainer.global_rank == 0:
        out = run_dir / f"island{island}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m lightning_islands.app.worker JOB.yaml``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m lightning_islands.app.worker JOB.yaml")
    torch.set_float32_matmul_precision("high")
    # Lightning 2.6 on torch 2.13 warns about its own use of a deprecated pytree API on every step.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    # Lightning's distributed checkpoint save overwrites last.ckpt on purpose, and torch warns each time.
    warnings.filterwarnings("ignore", message=r"Detected an existing checkpoint in .*overwriting")
    run(OmegaConf.load(argv[0]))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
