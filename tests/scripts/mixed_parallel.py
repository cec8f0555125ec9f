"""The provided MoE trained by islands that parallelize differently; used by tests.

``lightning-islands run --islands 2,1 -- python mixed_parallel.py --out DIR --tp 2,1`` runs island 0
as 2 processes of tensor parallelism and island 1 as 1 process of FSDP2 (``--ep``: expert parallel
sizes instead). Each island's rank 0 saves the global parameters and the state digest after every
outer step to ``DIR/island{i}_round{r}.pt``, and its mesh to ``DIR/island{i}_mesh.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

from lightning_islands.startup import startup_imports

# torch and Lightning: a fifth less CPU at start (see lightning_islands.startup)
with startup_imports(main=__name__ == "__main__"):
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_islands import IslandStrategy
    from lightning_islands.models import MoELanguageModel

TINY = dict(vocab_size=256, seq_len=16, d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_ff=64,
            warmup_steps=2, max_steps=100)


class Tokens(IterableDataset):
    """Random byte windows for (island, data-parallel rank), from inner step ``start`` on."""

    def __init__(self, island: int, rank: int, batch_size: int, start: int) -> None:
        self.island, self.rank, self.batch_size, self.start = island, rank, batch_size, start

    def __iter__(self):
        step = self.start
        while True:
            g = torch.Generator().manual_seed(1_000_003 * self.island + 10_007 * self.rank + step)
            x = torch.randint(0, 256, (self.batch_size, TINY["seq_len"] + 1), generator=g)
            yield x[:, :-1], x[:, 1:]
            step += 1


class Model(MoELanguageModel):
    def train_dataloader(self):
        strategy = self.trainer.strategy
        rank = strategy.distributed_sampler_kwargs["rank"]  # tensor-parallel ranks read the same batches
        return DataLoader(Tokens(strategy.island_index, rank, self.batch_size, self.trainer.global_step),
                          batch_size=None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--tp", default="1", help="tensor_parallel_size per island (comma list)")
    p.add_argument("--ep", default="1", help="expert_parallel_size per island (comma list)")
    p.add_argument("--batch-sizes", default="4", help="batch per data-parallel rank, per island (comma list)")
    p.add_argument("--codec", default="fp32")
    p.add_argument("--exchange", default="leader", help="islands.exchange: leader or sliced")
    p.add_argument("--experts", default="4", help="n_experts per island (comma list) to provoke a mismatch")
    p.add_argument("--ckpt-every", type=int, default=0, help="a checkpoint every N steps (DIR/ckpt_island{i}/)")
    p.add_argument("--resume", default=None, help="checkpoint path pattern with {island}")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    island = int(os.environ.get("LI_ISLAND", "0"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def per_island(text: str) -> int:
        values = text.split(",")
        return int(values[min(island, len(values) - 1)])

    torch.manual_seed(island)  # island 0's initial parameters win
    model = Model(**{**TINY, "n_experts": per_island(args.experts)})
    model.batch_size = per_island(args.batch_sizes)
    strategy = IslandStrategy(sync_every=args.H, outer_lr=0.7, outer_momentum=0.9, codec=args.codec, deadline_s=120,
                              exchange=args.exchange, tensor_parallel_size=per_island(args.tp),
                              expert_parallel_size=per_island(args.ep))

    def save_round(s: IslandStrategy) -> None:
        params, digest = s.global_parameters(), s.global_state_digest()
        if s.global_rank == 0:
            torch.save({"params": params, "round": s.round, "digest": digest, "metrics": s.last_round_metrics},
                       out / f"island{s.island_index}_round{s.round}.pt")

    strategy.round_callbacks.append(save_round)
    grads: dict[str, float] = {}

    class ExpertGradients(pl.Callback):  # the largest gradient each expert received, over the fit
        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
            for name, param in module.named_parameters():
                if param.grad is not None and ".mlp.w_" in name:
                    g = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
                    for e, row in enumerate(g.abs().flatten(1).amax(1).tolist()):
                        grads[f"{name}[{e}]"] = max(grads.get(f"{name}[{e}]", 0.0), row)

    callbacks: list[pl.Callback] = [ExpertGradients()]
    if args.ckpt_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=str(out / f"ckpt_island{island}"), save_top_k=-1,
                                                      every_n_train_steps=args.ckpt_every, filename="{step}"))
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy=strategy,
                         max_steps=args.steps, logger=False, enable_checkpointing=bool(args.ckpt_every),
                         callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, ckpt_path=args.resume.format(island=island) if args.resume else None)
    placements = {n: [str(x) for x in p.placements] for n, p in model.named_parameters() if hasattr(p, "placements")}
    if trainer.global_rank == 0:
        (out / f"island{island}_mesh.json").write_text(json.dumps({"mesh": strategy.parallel_sizes,
                                                                   "expert_grads": grads, "placements": placements}))


if __name__ == "__main__":
    main()
