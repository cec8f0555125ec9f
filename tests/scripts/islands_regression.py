"""A plain LightningModule (no configure_model) trained by the islands strategy; used by tests.

Run it as islands: ``lightning-islands run --islands 2,1 -- python islands_regression.py --out DIR``.
Each island's rank 0 saves the global parameters after every outer step to
``DIR/island{i}_round{r}.pt`` so tests can compare islands bit for bit and against a reference.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from lightning_islands.startup import startup_imports

# torch and Lightning: a fifth less CPU at start (see lightning_islands.startup)
with startup_imports(main=__name__ == "__main__"):
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_islands import IslandStrategy, RoundCheckpoint

DIM = 6
W_TRUE = torch.linspace(-1.0, 1.0, DIM * 2).view(2, DIM)


def batch_for(island: int, rank: int, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch that rank ``rank`` of island ``island`` trains on at inner step ``step``."""
    g = torch.Generator().manual_seed(1_000_003 * island + 10_007 * rank + step)
    x = torch.randn(batch_size, DIM, generator=g)
    y = x @ W_TRUE.T + 0.1 * torch.randn(batch_size, 2, generator=g) + island * 0.5
    return x, y


class Stream(IterableDataset):
    def __init__(self, island: int, rank: int, batch_size: int, start: int) -> None:
        self.island, self.rank, self.batch_size, self.start = island, rank, batch_size, start

    def __iter__(self):
        step = self.start
        while True:
            yield batch_for(self.island, self.rank, step, self.batch_size)
            step += 1


class SlowToPickle:
    """Stands for a large checkpoint: pickling it (inside the checkpoint write) takes ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self):
        time.sleep(self.seconds)
        return (dict, ())


class Regression(pl.LightningModule):
    def __init__(self, hidden: int = 8, inner: str = "sgd", lr: float = 0.05, two_optimizers: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(DIM, hidden), nn.Linear(hidden, 2)])
        self.register_buffer("calibration", torch.randn(3))  # unused: islands must agree on it anyway
        self.inner, self.lr = inner, lr
        self.two_optimizers = two_optimizers
        self.automatic_optimization = not two_optimizers

    def forward(self, x):
        return self.layers[1](self.layers[0](x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/loss", loss)
        if self.two_optimizers:  # manual optimization: one optimizer per layer, each with a scheduler
            opts, scheds = self.optimizers(), self.lr_schedulers()
            for opt in opts:
                opt.zero_grad()
            self.manual_backward(loss)
            for opt, sched in zip(opts, scheds):
                opt.step()
                sched.step()
            return None
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        if self.two_optimizers:
            opts = [torch.optim.SGD(layer.parameters(), lr=self.lr) for layer in self.layers]
            return opts, [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in opts]
        if self.inner == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        island = self.trainer.strategy.island_index
        return DataLoader(Stream(island, self.trainer.global_rank, self.batch_size, self.trainer.global_step),
                          batch_size=None)

    def on_save_checkpoint(self, checkpoint):
        if getattr(self, "save_delay", 0):  # the checkpoint file takes this long to write
            checkpoint["slow_to_write"] = SlowToPickle(self.save_delay)

    def val_dataloader(self):
        batches = [batch_for(99, r, 0, 4) for r in range(2)]
        return DataLoader(batches[self.trainer.global_rank :: self.trainer.world_size], batch_size=None)


class Killer(pl.Callback):
    """SIGKILLs this process, as a lost machine ends: after inner step ``step`` (``phase="inner"``),
    or in the exchange of round ``round_`` (``"exchange"``: the headers agreed, its payload not sent;
    ``"slice"``: the same on a rank other than the leader, in its own slice's transfer).
    With ``sig="STOP"`` it SIGSTOPs itself instead (alive, silent, no TCP reset), after writing its
    pid to ``pid_file``; with ``sig="LINKDOWN"`` it takes its own veth down (inside a shaped link's
    namespace: its packets stop, nothing is reset) and then waits, cut off, until it is killed."""

    def __init__(self, phase: str, step: int, round_: int, sig: str = "KILL", pid_file: Path | None = None) -> None:
        self.phase, self.step, self.round = phase, step, round_
        self.signal = None if sig == "LINKDOWN" else getattr(signal, f"SIG{sig}")
        self.pid_file = pid_file
        self.fallen = False

    def _fall(self, where: str, island: int) -> None:
        if self.fallen:  # a cut-off island trains on: it falls once
            return
        self.fallen = True
        if self.pid_file is not None:
            self.pid_file.write_text(str(os.getpid()))
        if self.signal is None:
            device = os.environ["LI_LINK_IFNAME"]  # only inside a shaped link's namespace
            subprocess.run(["ip", "link", "set", device, "down"], check=True)
            state = subprocess.run(["ip", "-o", "link", "show", device], capture_output=True, text=True).stdout
            print(f"cutting island {island}'s link {where}: {device} is {'down' if 'state DOWN' in state else state}",
                  flush=True)
            # Cut off, it would end on its own once its coordinator connection times out; it waits
            # here instead (the others see the same: no packets) until the test ends it.
            threading.Event().wait()
        verb = "killing" if self.signal == signal.SIGKILL else "stopping"
        print(f"{verb} island {island} {where}", flush=True)
        os.kill(os.getpid(), self.signal)

    def on_train_start(self, trainer, module) -> None:
        engine = trainer.strategy.engine
        link = engine.link if self.phase == "exchange" else engine.rank_link if self.phase == "slice" else None
        if link is None:  # "slice": a rank other than the leader, in its own slice's transfer (exchange=sliced)
            return
        inner = getattr(link, "link", link)  # under an AuthenticatedLink
        send = inner.all_gather_bytes

        def dying(payload, limit=None):
            if trainer.strategy.engine.schedule.round == self.round:
                self._fall(f"in round {self.round}'s exchange", trainer.strategy.island_index)
            return send(payload, limit)

        inner.all_gather_bytes = dying

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.phase == "inner" and trainer.global_step == self.step:
            self._fall(f"after step {self.step}", trainer.strategy.island_index)


class HoldForRejoin(pl.Callback):
    """Pauses this (surviving) island after inner step ``step`` until island ``island`` is back in its
    rounds or has asked the coordinator to take it back (its join request is there), so that a
    restarted island always gets back in before the survivors end the run, however long its restart
    takes on this machine."""

    def __init__(self, step: int, island: int, timeout_s: float = 240.0) -> None:
        self.step, self.island, self.timeout_s = step, island, timeout_s

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        me, link = trainer.strategy.island_index, trainer.strategy.engine.link
        print(f"island {me} holds at step {self.step} until island {self.island} is back or asks to rejoin",
              flush=True)
        deadline = time.monotonic() + self.timeout_s
        while not self._back_or_asking(link):
            if time.monotonic() > deadline:
                raise TimeoutError(f"island {self.island} neither came back nor asked to rejoin within "
                                   f"{self.timeout_s:g} s")
            time.sleep(0.05)
        print(f"island {self.island} is back or asked to rejoin; island {me} goes on", flush=True)

    def _back_or_asking(self, link) -> bool:
        if link is None:  # a leader only: the other ranks wait in the next collective
            return True
        link = getattr(link, "link", link)  # under an AuthenticatedLink
        link.membership.read_enrolments()  # a new island (joining) is looked for once enrolled
        return self.island in link.present or self.island in link.membership.joiners(1 << 62)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", default="12", help="max_steps (comma list: per island)")
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--sync-warmup", default="", help="H of the first rounds (comma list)")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--nesterov", type=int, default=1)
    p.add_argument("--outer-lr-warmup", type=int, default=0, help="rounds of outer lr warm-up")
    p.add_argument("--momentum-warmup", type=int, default=0, help="rounds of outer momentum warm-up")
    p.add_argument("--codec", default="fp32")
    p.add_argument("--error-feedback", type=int, default=-1)
    p.add_argument("--ef-decay", type=float, default=1.0, help="the strategy's error_feedback_decay")
    p.add_argument("--batch-sizes", default="4,8")
    p.add_argument("--hidden", default="8", help="hidden size per island (comma list) to provoke mismatches")
    p.add_argument("--outer-lrs", default=None, help="outer lr per island (comma list) to provoke mismatches")
    p.add_argument("--inner", default="sgd")
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--round-ckpt-every", type=int, default=0, help="RoundCheckpoint(every_n_rounds), rounds_island{i}")
    p.add_argument("--keep-rounds", type=int, default=2, help="RoundCheckpoint(keep)")
    p.add_argument("--resume", default=None, help="checkpoint path pattern with {island}")
    p.add_argument("--fail-island", type=int, default=-1)
    p.add_argument("--val-every", type=int, default=0)
    p.add_argument("--delays", default="0", help="seconds to sleep after each batch, per island (comma list)")
    p.add_argument("--first-step-delay", default="0", help="extra seconds after the first batch, per island")
    p.add_argument("--balance", default="none")
    p.add_argument("--max-rounds", type=int, default=0)
    p.add_argument("--two-optimizers", type=int, default=0)
    p.add_argument("--steps-per-round", default="0", help="inner steps per round per island (comma list)")
    p.add_argument("--eval-ckpt", default=None, help="validate this islands checkpoint instead of training")
    p.add_argument("--precisions", default="32-true", help="Trainer precision per island (comma list)")
    p.add_argument("--accelerators", default="cpu", help="Trainer accelerator per island (comma list: cpu, gpu)")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--same-seed", type=int, default=0, help="every island builds its model from seed 0")
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--final-ckpt", type=int, default=0, help="save final_island{i}.ckpt after fit")
    p.add_argument("--deadline-s", type=float, default=120.0, help="the strategy's deadline_s")
    p.add_argument("--save-delay", default="0", help="seconds each checkpoint write takes, per island (comma list)")
    p.add_argument("--early-stop-island", type=int, default=-1,
                   help="this island gets an EarlyStopping callback that fires at its first validation")
    p.add_argument("--flush-subnormals", default="0", help="1: the island flushes subnormal floats (comma list)")
    p.add_argument("--nan-island", type=int, default=-1, help="this island's parameters turn NaN at --nan-step")
    p.add_argument("--nan-step", type=int, default=0)
    p.add_argument("--fragments", type=int, default=1, help="the strategy's fragments")
    p.add_argument("--overlap", type=int, default=0, help="the strategy's overlap_steps")
    p.add_argument("--topology", default="allreduce", help="the strategy's topology")
    p.add_argument("--exchange", default="leader", help="the strategy's exchange (leader, sliced)")
    p.add_argument("--max-staleness", type=int, default=0, help="the strategy's max_staleness")
    p.add_argument("--alpha", type=float, default=0.0, help="the strategy's overlap_alpha")
    p.add_argument("--exchange-chunk-mib", type=float, default=1024.0, help="the strategy's exchange_chunk_mib")
    p.add_argument("--kill-island", type=int, default=-1, help="this island SIGKILLs itself (first start only)")
    p.add_argument("--kill-step", type=int, default=0, help="...after this inner step (--kill-phase inner)")
    p.add_argument("--kill-round", type=int, default=0, help="...in this round's exchange (--kill-phase exchange)")
    p.add_argument("--kill-phase", default="inner", choices=["inner", "exchange", "slice"])
    p.add_argument("--kill-signal", default="KILL", choices=["KILL", "STOP", "LINKDOWN"],
                   help="STOP: the island stops itself (alive, silent) and writes its pid to pid_island{i}; "
                        "LINKDOWN: it takes its veth down (needs --link)")
    p.add_argument("--fault", action="append", default=[], metavar="ISLAND:PHASE:AT:SIGNAL",
                   help="one more fault (repeatable): island ISLAND falls after inner step AT (PHASE inner) or "
                        "in round AT's exchange (PHASE exchange) by SIGNAL (KILL, STOP, LINKDOWN)")
    p.add_argument("--hold-for-rejoin", type=int, default=0,
                   help="islands other than --kill-island pause after this inner step until it asks to rejoin")
    p.add_argument("--rejoiner", type=int, default=-1, help="the island --hold-for-rejoin waits for (--kill-island)")
    p.add_argument("--restart-waits-for", default=None, help="a restarted island waits for this file, then resumes "
                   "from its latest round checkpoint")
    p.add_argument("--min-islands", type=int, default=1, help="the strategy's min_islands")
    p.add_argument("--grace-s", type=float, default=0.0, help="the strategy's grace_s (0: default)")
    p.add_argument("--staleness-wait-s", type=float, default=None, help="the strategy's staleness_wait_s")
    p.add_argument("--on-end", default="stop", help="the strategy's on_end per island (comma list: stop, leave)")
    args = p.parse_args()
    island = int(os.environ.get("LI_ISLAND", "0"))
    if island == args.fail_island:
        raise RuntimeError(f"island {island} was told to fail")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    # Registered before the strategy's own exit hook, so it runs after it (atexit is LIFO): by then
    # the world must be destroyed, or a gloo worker thread can abort the process during finalization.
    atexit.register(lambda: (out / f"exit_island{island}_rank{rank}").write_text(str(dist.is_initialized())))
    # islands start from different seeds: island 0's parameters must win (unless --same-seed)
    torch.manual_seed(0 if args.same_seed else island)

    def per_island(text: str, cast=int):
        """This island's entry of a comma list (the last entry for islands beyond it)."""
        values = text.split(",")
        return cast(values[min(island, len(values) - 1)])

    if per_island(args.flush_subnormals):
        torch.set_flush_denormal(True)
    model = Regression(hidden=per_island(args.hidden), inner=args.inner,
                       two_optimizers=bool(args.two_optimizers))
    model.batch_size = per_island(args.batch_sizes)
    model.save_delay = per_island(args.save_delay, float)
    outer_lr = args.outer_lr
    if args.outer_lrs:
        outer_lr = [float(v) for v in args.outer_lrs.split(",")][island]
    warmup = [int(h) for h in args.sync_warmup.split(",") if h]
    strategy = IslandStrategy(sync_every=args.H, sync_warmup=warmup, outer_lr=outer_lr, outer_momentum=args.momentum,
                              nesterov=bool(args.nesterov), codec=args.codec, deadline_s=args.deadline_s,
                              outer_lr_warmup=args.outer_lr_warmup, outer_momentum_warmup=args.momentum_warmup,
                              error_feedback=None if args.error_feedback < 0 else bool(args.error_feedback),
                              error_feedback_decay=args.ef_decay,
                              balance=args.balance, max_rounds=args.max_rounds or None,
                              steps_per_round=per_island(args.steps_per_round) or None,
                              exchange_chunk_mib=args.exchange_chunk_mib, fragments=args.fragments,
                              overlap_steps=args.overlap, overlap_alpha=args.alpha, min_islands=args.min_islands,
                              grace_s=args.grace_s or None, on_end=per_island(args.on_end, str),
                              topology=args.topology, exchange=args.exchange, max_staleness=args.max_staleness,
                              staleness_wait_s=args.staleness_wait_s)

    def save_round(s: IslandStrategy) -> None:
        params = s.global_parameters()
        digest = s.global_state_digest()
        if s.global_rank == 0:
            torch.save({"params": params, "round": s.round, "metrics": s.last_round_metrics, "digest": digest,
                        "inner_steps": s.engine.schedule.inner_steps,
                        "restarted": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                        "initial_state_broadcast": s.engine.initial_state_broadcast,
                        "buffers": {n: b.detach().cpu().clone() for n, b in s.lightning_module.named_buffers()},
                        "ef_device": str(s.engine.state.residual[0].device) if s.engine.state.residual else None},
                       out / f"island{s.island_index}_round{s.round}.pt")

    strategy.round_callbacks.append(save_round)
    callbacks = []
    if args.nan_island == island:

        class Diverge(pl.Callback):  # the inner step of --nan-step leaves NaN in every parameter
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
                if trainer.global_step == args.nan_step:
                    with torch.no_grad():
                        for p in module.parameters():
                            p.to_local().fill_(float("nan")) if hasattr(p, "to_local") else p.fill_(float("nan"))

        callbacks.append(Diverge())
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    at = args.kill_step if args.kill_phase == "inner" else args.kill_round  # exchange, slice: a round
    faults = [f"{args.kill_island}:{args.kill_phase}:{at}:{args.kill_signal}", *args.fault]
    for fault in faults:
        who, phase, at, sig = fault.split(":")
        if int(who) == island and not restarted:
            callbacks.append(Killer(phase, int(at), int(at), sig, out / f"pid_island{island}"))
    rejoiner = args.rejoiner if args.rejoiner >= 0 else args.kill_island
    if args.hold_for_rejoin and island != rejoiner:
        callbacks.append(HoldForRejoin(args.hold_for_rejoin, rejoiner))
    delay = per_island(args.delays, float)
    first_delay = per_island(args.first_step_delay, float)
    if delay or first_delay:
        class Delay(pl.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
                time.sleep(delay + (first_delay if batch_idx == 0 else 0.0))

        callbacks.append(Delay())
    if island == args.early_stop_island:  # stopping_threshold: "good enough" at once -> trainer.should_stop
        callbacks.append(pl.callbacks.EarlyStopping(monitor="val/loss", stopping_threshold=1e9))
    if args.ckpt_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=str(out / f"ckpt_island{island}"),
                                                      every_n_train_steps=args.ckpt_every, save_top_k=-1,
                                                      filename="{step}"))
    if args.round_ckpt_every:
        callbacks.append(RoundCheckpoint(out / f"rounds_island{island}", every_n_rounds=args.round_ckpt_every,
                                         keep=args.keep_rounds))
    trainer = pl.Trainer(accelerator=per_island(args.accelerators, str),
                         devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy=strategy,
                         max_steps=per_island(args.steps),
                         logger=False, enable_checkpointing=bool(args.ckpt_every),
                         callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         val_check_interval=args.val_every or None, limit_val_batches=1 if args.val_every else 0,
                         num_sanity_val_steps=0, accumulate_grad_batches=args.accumulate,
                         gradient_clip_val=args.clip or None,
                         precision=per_island(args.precisions, str))
    if args.eval_ckpt:  # a fresh process validating a checkpoint must see the global weights
        trainer.validate(model, ckpt_path=args.eval_ckpt, verbose=False)
        full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in model.named_parameters()}
        if trainer.global_rank == 0:
            torch.save({n: t.cpu() for n, t in full.items()}, out / "eval_params.pt")
        return
    ckpt = args.resume.format(island=island) if args.resume else None
    if restarted and args.restart_waits_for:  # like the app: back from its own latest round checkpoint
        while not Path(args.restart_waits_for).exists():
            time.sleep(0.05)
        ckpt = str(out / f"rounds_island{island}")
    trainer.fit(model, ckpt_path=ckpt)
    if args.final_ckpt:  # like the app's final.ckpt: after the last outer step
        trainer.save_checkpoint(str(out / f"final_island{island}.ckpt"))
    if trainer.global_rank == 0:
        (out / f"island{island}_done").write_text(str(strategy.round))
        (out / f"island{island}_steps").write_text(str(trainer.global_step))


if __name__ == "__main__":
    main()
