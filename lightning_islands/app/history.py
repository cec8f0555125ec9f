"""What happened in a run, written by the run itself, whatever the logger: ``island{i}/history.jsonl``.

:class:`History` (a Lightning callback the app adds to every island's Trainer) appends one JSON line
per event on the island's rank 0:

- ``{"event": "start", "island", "tokens_per_step", "t": 0}`` when the fit starts;
- ``{"event": "round", "round", "step", "t", "tokens", ...}`` after every outer round: the island's
  tokens merged so far and the round's bytes sent and received, seconds exchanging, waiting and
  blocking, islands present, left out and repaired (:data:`ROUND_KEYS`);
- ``{"event": "val", "step", "t", "tokens", "round", "val_loss"}`` after every validation.

``t`` is seconds since the island's first start (a restarted island continues the file and its
clock: its own ``start`` line marks the restart). :func:`read_history` reads it back;
``lightning-islands report`` draws from it (docs/METRICS.md lists every metric).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

# what a round line keeps of the round's islands/* metrics
ROUND_KEYS = ("bytes_sent", "bytes_received", "seconds_exchanging", "seconds_waiting", "seconds_blocking",
              "islands_present", "islands_left_out", "islands_repaired", "round_tokens", "payload_bytes",
              "run_tokens", "staleness", "spread", "butterfly_stage")


class History(pl.Callback):
    """Append this island's rounds and validations to ``path`` (JSON lines, rank 0 only).

    Args:
        path: the file (``RUN/island{i}/history.jsonl`` in the app); appended to, so a restarted
            island continues it.
        island: this island's index.
        tokens_per_step: tokens the island trains per optimizer step (all its data-parallel ranks).
    """

    def __init__(self, path: str | Path, island: int, tokens_per_step: float) -> None:
        self.path = Path(path)
        self.island = island
        self.tokens_per_step = float(tokens_per_step)
        self._origin = time.time()  # wall time of the island's first start (the file's first line)
        self._trainer: pl.Trainer | None = None

    def _write(self, record: dict[str, Any]) -> None:
        if self._trainer is None or self._trainer.global_rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            now = time.time()
            f.write(json.dumps({**record, "t": round(now - self._origin, 4), "wall": now}) + "\n")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer
        earlier = read_history(self.path) if self.path.exists() else []
        self._origin = float(earlier[0]["wall"]) if earlier and "wall" in earlier[0] else time.time()
        hooks = getattr(trainer.strategy, "round_callbacks", None)
        if hooks is not None and self._round not in hooks:
            hooks.append(self._round)
        self._write({"event": "start", "island": self.island, "tokens_per_step": self.tokens_per_step,
                     "step": trainer.global_step})

    def _tokens(self, trainer: pl.Trainer) -> float:
        merged = getattr(trainer.strategy, "total_tokens", None)  # islands: tokens merged into the global model
        return float(merged) if merged is not None else trainer.global_step * self.tokens_per_step

    def _round(self, strategy: Any) -> None:
        metrics = strategy.last_round_metrics
        record = {"event": "round", "round": strategy.round, "step": self._trainer.global_step if self._trainer else 0,
                  "tokens": float(strategy.total_tokens)}
        record.update({k: float(metrics[f"islands/{k}"]) for k in ROUND_KEYS if f"islands/{k}" in metrics})
        self._write(record)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or "val/loss" not in trainer.callback_metrics:
            return
        self._write({"event": "val", "step": trainer.global_step, "tokens": self._tokens(trainer),
                     "round": int(getattr(trainer.strategy, "round", 0)),
                     "val_loss": float(trainer.callback_metrics["val/loss"])})


def read_history(path: str | Path) -> list[dict[str, Any]]:
    """The records of one ``history.jsonl`` (a torn last line, from a crash mid-write, is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def run_histories(run_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """Every island's history of a run folder, by island index (empty for a run without any)."""
    found = {}
    for path in sorted(Path(run_dir).glob("island*/history.jsonl")):
        suffix = path.parent.name.removeprefix("island")
        if suffix.isdigit():
            found[int(suffix)] = read_history(path)
    return found
