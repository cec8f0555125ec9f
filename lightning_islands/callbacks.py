"""RoundCheckpoint: each island's checkpoints by outer round, so islands resume together.

Islands of different speeds (time balancing) reach the same step at different rounds, so their
step-numbered checkpoints rarely hold the same global state. Checkpoints named by round do: after
round ``r`` every island's ``round{r:06d}.ckpt`` holds the same global parameters and outer state.
Give each island its folder as ``ckpt_path`` and the islands resume from the last round every one
of them kept (``trainer.fit(model, ckpt_path=dirpath)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_islands.engine.saves import prune_rounds, round_path
from lightning_islands.strategy import IslandStrategy


class RoundCheckpoint(pl.Callback):
    """Save the island's checkpoint every ``every_n_rounds`` outer rounds as
    ``dirpath/round{r:06d}.ckpt`` and keep the newest ``keep`` of them.

    The checkpoint is taken at the end of the first training batch after the round (a round in
    flight lands first, so it holds whole rounds), and after the last round at the end of the fit;
    it is written aside and moved into place durably
    (a crash at any point leaves the last complete one findable). Needs :class:`IslandStrategy`.

    Args:
        dirpath: the island's folder of round checkpoints (one per island).
        every_n_rounds: save after every this many rounds (>= 1).
        keep: how many of the newest round checkpoints to keep (>= 1; 2 lets islands that are a
            round apart still share one).
    """

    def __init__(self, dirpath: str | Path, every_n_rounds: int = 1, keep: int = 2) -> None:
        if int(every_n_rounds) != every_n_rounds or every_n_rounds < 1:
            raise ValueError(f"every_n_rounds must be a whole number >= 1, got {every_n_rounds!r}")
        if int(keep) != keep or keep < 1:
            raise ValueError(f"keep must be a whole number >= 1 (the round checkpoints to keep), got {keep!r}")
        self.dirpath, self.every_n_rounds, self.keep = Path(dirpath), int(every_n_rounds), int(keep)
        self._last = 0  # the round of the last checkpoint (or of the start)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, IslandStrategy):
            raise TypeError(f"RoundCheckpoint needs strategy=IslandStrategy(...), not "
                            f"{type(trainer.strategy).__name__}; use ModelCheckpoint for step-numbered checkpoints")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = trainer.strategy.round  # type: ignore[attr-defined]  # a resumed fit: not again

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        strategy: IslandStrategy = trainer.strategy  # type: ignore[assignment]
        if strategy.round // self.every_n_rounds > self._last // self.every_n_rounds:
            self._save(trainer, strategy)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy: IslandStrategy = trainer.strategy  # type: ignore[assignment]
        if strategy.round > self._last:  # the last round (after the last batch), whatever every_n_rounds
            self._save(trainer, strategy)

    def _save(self, trainer: pl.Trainer, strategy: IslandStrategy) -> None:
        strategy.land()
        self._last = strategy.round
        trainer.save_checkpoint(round_path(self.dirpath, self._last))
        strategy.on_rank_zero(lambda: prune_rounds(self.dirpath, self.keep))
