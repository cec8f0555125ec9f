"""A training script to adapt: your LightningModule trained by IslandStrategy, its data sharded by island and rank.

    python examples/train.py --max-steps 4                      # one island, no coordinator
    lightning-islands run --islands 2,1 -- python examples/train.py --max-steps 60 --sync-every 20
    # across machines or sites: examples/README.md (torchrun per island) and examples/slurm_island.sbatch

To adapt it, replace ``CharModel`` with your module and ``windows`` with your dataset; keep
``use_distributed_sampler=False`` and the ``IslandSampler`` of ``train_dataloader``. Each island's
rank 0 prints the validation loss of the final global model and a checksum of the global state:
after the last outer step it is the same on every island.
"""

from __future__ import annotations

import argparse
import inspect
import os

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_islands import IslandStrategy
from lightning_islands.data import IslandSampler


def windows(text: bytes, context: int) -> TensorDataset:
    """Every ``context`` consecutive bytes of ``text`` with the byte that follows them (no download)."""
    data = torch.tensor(list(text), dtype=torch.long)
    return TensorDataset(data.unfold(0, context, 1)[:-1], data[context:])


class CharModel(pl.LightningModule):
    """A tiny byte-level MLP: the next byte from the ``context`` bytes before it."""

    def __init__(self, text: bytes, context: int = 16, width: int = 16, hidden: int = 64, lr: float = 3e-3,
                 batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["text"])
        cut = len(text) * 9 // 10  # the last tenth validates: the same bytes on every island
        self.train_set, self.val_set = windows(text[:cut], context), windows(text[cut:], context)
        self.embed = nn.Embedding(256, width)
        self.mlp = nn.Sequential(nn.Flatten(), nn.Linear(context * width, hidden), nn.GELU(), nn.Linear(hidden, 256))

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.embed(x))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log("train/loss", loss)  # the launcher's live status line shows it
        return loss

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.log("val/loss", F.cross_entropy(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)  # the inner optimizer

    def train_dataloader(self) -> DataLoader:
        # This island's share, split over its ranks; the same seed everywhere keeps the shares disjoint.
        sampler = IslandSampler.for_trainer(self.train_set, self.trainer, seed=self.hparams.seed)
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        # The same validation set on every island (as if one island), split over this island's ranks
        # (drop_last: fewer than world-size windows left out, none when its length divides evenly).
        sampler = IslandSampler.for_trainer(self.val_set, self.trainer, island=0, num_islands=1, shuffle=False)
        return DataLoader(self.val_set, batch_size=256, sampler=sampler)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--max-steps", type=int, default=200, help="inner steps of each island")
    p.add_argument("--sync-every", type=int, default=50, help="inner steps per outer round (H)")
    p.add_argument("--codec", default="int4", help="wire format of pseudo-gradients (fp32, bf16, int8, int4, ...)")
    p.add_argument("--accelerator", default="auto", help="cpu, gpu or auto")
    p.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                   help="processes of this island per node (default: torchrun's --nproc-per-node)")
    p.add_argument("--num-nodes", type=int, default=1, help="nodes of this island")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    p.add_argument("--text-bytes", type=int, default=200_000, help="bytes of text to train on")
    p.add_argument("--seed", type=int, default=0, help="data order (the same on every island)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)  # each island builds its model; island 0's initial parameters win anyway
    text = "".join(inspect.getsource(m) for m in (argparse, inspect)).encode()[: args.text_bytes]
    model = CharModel(text, batch_size=args.batch_size, seed=args.seed)
    strategy = IslandStrategy(sync_every=args.sync_every, codec=args.codec)  # identity: LI_* environment
    trainer = pl.Trainer(
        strategy=strategy, accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
        max_steps=args.max_steps, use_distributed_sampler=False,  # IslandSampler shards by island and rank
        limit_val_batches=1.0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=os.environ.get("LI_PROGRESS_BAR", "1") != "0", enable_model_summary=False)
    trainer.fit(model)
    val_loss = float(trainer.validate(model, verbose=False)[0]["val/loss"])  # the final global model
    digest = strategy.global_state_digest()  # a collective of the island: every rank calls it
    if trainer.global_rank == 0:
        print(f"island {strategy.island_index} of {strategy.num_islands}: {strategy.round} rounds, "
              f"{trainer.global_step} steps, val_loss {val_loss:.4f}, global state sha256 {digest}", flush=True)


if __name__ == "__main__":
    main()
