"""A callback the app tests add from the command line (``+callbacks.seen={_target_: ...}``): at the end
of training it writes which ``islands/*`` metrics ``trainer.callback_metrics`` held, and their values."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl


class RoundMetricsSeen(pl.Callback):
    """Writes ``{metric: value}`` of the ``islands/*`` callback metrics to ``path`` (rank 0)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            seen = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("islands/")}
            self.path.write_text(json.dumps(seen))
