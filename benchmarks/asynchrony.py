"""Asynchronous islands: four islands, one slow for stretches and one behind a slower link.

Usage (from the repository root, as root for the shaped link)::

    python benchmarks/asynchrony.py --quick --out results/asynchrony     # one seed, ~15 min on 2 cores
    python benchmarks/asynchrony.py --seeds 1234,2 --out results/asynchrony

Every run is one ``python -m lightning_islands.app.train islands=four_uneven`` subprocess: four
one-process islands of the provided MoE on the default corpus, each batch 8. Island 3 sleeps
``--delay`` seconds after each of its batches for the first third of its planned steps, not at all
for the second third, and again for the last (a shared cluster's changing speed: about 3x slower,
then 1x, then 3x). Island 2 is behind a slower link (``islands.link=RATE,RTT,2=SLOW``, network
namespaces and ``tc``; without them, ``--no-link``). Every configuration trains the same total
tokens (``islands.max_tokens``: the run stops after the round whose merged tokens reach it; a fast
island trains more of them), with the learning-rate schedule of the synchronous run's steps:

- ``sync``: ``topology=allreduce``, ``balance=none``: every round waits for every island;
- ``balanced``: ``balance=time``: each island runs the steps that fit the slowest island's H steps;
- ``butterfly``: ``topology=butterfly``: pairs mix, one payload per round, still a barrier;
- ``async``: ``max_staleness=S``: a majority does not wait past ``staleness_wait_s`` (``--wait``)
  for a slow island, whose work lands up to S rounds late (weight decayed by age);
- ``async+butterfly``: both.

Per run (``DIR/asynchrony.json``, one row per configuration and seed): ``wall_s`` (the longest
island's fit time), ``tokens`` (merged: the run stops after the round that reaches the budget, so
a configuration of long rounds overshoots it), ``wall_per_budget_s`` (``wall_s`` scaled to the
budget), ``val_loss`` (the mean over islands of each island's final global model; the butterfly's
islands hold different ones, a late island an older one), ``val_loss_island0``,
``bytes_received_per_round`` (mean over islands of bytes received over rounds taken part in),
``staleness`` (a histogram of the ages of the pseudo-gradients merged: ``{age: count}``),
``rounds``, ``cpu_s`` (CPU seconds of the launch and all its processes) with ``cpu_busy`` (that
over the launch's wall time times the machine's cores: how near the run is to being bound by the
cores rather than by waiting) and the rows' ratios to ``sync`` of the same seed. ``DIR/asynchrony.md`` is the table (and
the mean over seeds), ``DIR/loss_vs_wall.png`` the validation loss of island 0 against wall time,
one line per configuration (with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

CONFIGS: dict[str, list[str]] = {
    "sync": [],
    "balanced": ["islands.balance=time"],
    "butterfly": ["islands.topology=butterfly"],
    "async": ["islands.max_staleness={S}", "islands.staleness_wait_s={W}"],
    "async+butterfly": ["islands.topology=butterfly", "islands.max_staleness={S}", "islands.staleness_wait_s={W}"],
}
SEQ_LEN, BATCH, ISLANDS = 128, 8, 4


def overrides(config: str, seed: int, args: argparse.Namespace) -> list[str]:
    """The Hydra overrides of one run."""
    steps = args.steps  # each island's steps in the synchronous run: the LR schedule's length
    third = steps // 3
    delay = f"'{args.delay},0@{third},{args.delay}@{2 * third}'"
    out = ["islands=four_uneven", f"seed={seed}", f"islands.sync_every={args.H}", f"islands.grace_s={args.grace}",
           f"islands.max_tokens={ISLANDS * steps * BATCH * SEQ_LEN}", f"islands.members.3.step_delay_s={delay}",
           f"model.max_steps={steps}", f"trainer.max_steps={8 * steps}", f"trainer.val_check_interval={args.H * 2}",
           "trainer.checkpoint_every_n_steps=0", "trainer.checkpoint_every_n_rounds=0",
           f"experiment.name=asynchrony_{config}"]
    if args.link:
        out.append(f"islands.link='{args.link}'")
    return out + [o.format(S=args.staleness, W=args.wait) for o in CONFIGS[config]]


def run(config: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One run; its row."""
    log = out / f"{config}_s{seed}.log"
    cmd = [sys.executable, "-m", "lightning_islands.app.train", *overrides(config, seed, args)]
    started, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    with log.open("w") as f:
        done = subprocess.run(cmd, cwd=out, stdout=f, stderr=subprocess.STDOUT, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the launch and every island process it reaped
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    launch_s = time.monotonic() - started
    text = log.read_text()
    if done.returncode != 0 or "run folder " not in text:
        raise RuntimeError(f"{config} (seed {seed}) failed: see {log}\n{text[-3000:]}")
    run_dir = Path(text.split("run folder ", 1)[1].split()[0])
    run_dir = run_dir if run_dir.is_absolute() else out / run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    histories = {int(p.parent.name.removeprefix("island")): [json.loads(line) for line in p.read_text().splitlines()]
                 for p in run_dir.glob("island*/history.jsonl")}
    rounds = [r for h in histories.values() for r in h if r.get("event") == "round"]
    ages = Counter(int(r["staleness"]) for r in rounds if r.get("staleness", 0) >= 1)
    per_island = [sum(r.get("bytes_received", 0.0) for r in h if r.get("event") == "round")
                  / max(1, sum(1 for r in h if r.get("event") == "round")) for h in histories.values()]
    curve = [(r["t"], r["val_loss"]) for r in histories.get(0, []) if r.get("event") == "val"]
    budget = ISLANDS * args.steps * BATCH * SEQ_LEN
    return {"config": config, "seed": seed, "wall_s": summary["wall_seconds"],
            "wall_per_budget_s": summary["wall_seconds"] * budget / max(1, summary["tokens"]),
            "val_loss": statistics.fmean(summary["val_loss_per_island"]), "val_loss_island0": summary["val_loss"],
            "val_loss_per_island": summary["val_loss_per_island"], "tokens": summary["tokens"],
            "rounds": summary.get("rounds"), "bytes_received_per_round": statistics.fmean(per_island),
            "staleness": dict(sorted(ages.items())), "curve": curve, "run_dir": str(run_dir),
            "launch_s": launch_s, "cpu_s": cpu_s, "cpu_busy": cpu_s / (launch_s * (os.cpu_count() or 1)),
            "overrides": overrides(config, seed, args)}


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown table: every row with its ratios to ``sync`` of its seed, then the means."""
    sync = {r["seed"]: r for r in rows if r["config"] == "sync"}
    lines = ["| config | seed | wall (s) | vs sync | tokens | val loss (mean of islands) | vs sync | island 0 | "
             "bytes in / round | rounds | stale merges (age: count) | CPU s (busy) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = sync.get(r["seed"])
        wall = f"{r['wall_s'] / base['wall_s']:.3f}" if base else "-"
        loss = f"{r['val_loss'] / base['val_loss']:.4f}" if base else "-"
        lines.append(f"| {r['config']} | {r['seed']} | {r['wall_s']:.1f} | {wall} | {r['tokens']:,} | "
                     f"{r['val_loss']:.4f} | {loss} | "
                     f"{r['val_loss_island0']:.4f} | {r['bytes_received_per_round'] / 1e6:.2f} MB | {r['rounds']} | "
                     f"{r['staleness'] or '-'} | {r.get('cpu_s', 0):.0f} ({r.get('cpu_busy', 0):.2f}) |")
    seeds = sorted({r["seed"] for r in rows})
    if len(seeds) > 1:
        lines += ["", "| config | mean wall (s) | vs sync | vs balanced | mean val loss | vs sync |",
                  "|---|---|---|---|---|---|"]
        mean = {c: (statistics.fmean(r["wall_s"] for r in rows if r["config"] == c),
                    statistics.fmean(r["val_loss"] for r in rows if r["config"] == c))
                for c in dict.fromkeys(r["config"] for r in rows)}
        nan = (float("nan"), float("nan"))
        sync, balanced = mean.get("sync", nan), mean.get("balanced", nan)
        for c, (wall, loss) in mean.items():
            lines.append(f"| {c} | {wall:.1f} | {wall / sync[0]:.3f} | {wall / balanced[0]:.3f} | {loss:.4f} | "
                         f"{loss / sync[1]:.4f} |")
    return lines


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Island 0's validation loss against wall time, one line per configuration (first seed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    first = min(r["seed"] for r in rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if r["seed"] == first and r["curve"]:
            ts, losses = zip(*r["curve"])
            ax.plot(ts, losses, marker=".", label=r["config"])
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("validation loss (island 0's global model)")
    ax.set_title(f"four islands, one slow and behind a slower link (seed {first})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one seed, 60 steps per island: under 15 min here")
    parser.add_argument("--seeds", default="1234,2", help="comma list (--quick: the first)")
    parser.add_argument("--steps", type=int, default=150, help="each island's steps in the synchronous run")
    parser.add_argument("--H", type=int, default=15, help="inner steps per round")
    parser.add_argument("--delay", type=float, default=1.0, help="seconds island 3 sleeps per batch when slow")
    parser.add_argument("--staleness", type=int, default=4, help="max_staleness of the async configurations")
    parser.add_argument("--grace", type=float, default=3.0, help="islands.grace_s of every configuration")
    parser.add_argument("--wait", type=float, default=0.5,
                        help="islands.staleness_wait_s of the async configurations: how long a majority waits for "
                             "a slow island")
    parser.add_argument("--link", default="1gbit,50ms,2=30mbit", help="islands.link ('' for none)")
    parser.add_argument("--no-link", dest="link", action="store_const", const="", help="no shaped link")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma list of " + ", ".join(CONFIGS))
    parser.add_argument("--out", default="results/asynchrony")
    parser.add_argument("--table", metavar="JSON", nargs="*", help="only print the table of these asynchrony.json "
                        "files together (runs made in several sittings), into --out")
    args = parser.parse_args()
    if args.table:
        rows = [r for path in args.table for r in json.loads(Path(path).read_text())]
        order = list(CONFIGS)
        rows.sort(key=lambda r: (r["seed"], order.index(r["config"])))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "asynchrony.json").write_text(json.dumps(rows, indent=2))
        lines = table(rows)
        print("\n".join(lines))
        (Path(args.out) / "asynchrony.md").write_text("\n".join(lines) + "\n")
        plot(rows, Path(args.out) / "loss_vs_wall.png")
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.quick:
        seeds, args.steps, args.H = seeds[:1], 60, 10
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in seeds:
        for config in args.configs.split(","):
            rows.append(run(config, seed, args, out))
            print(f"{config} seed {seed}: wall {rows[-1]['wall_s']:.1f} s, val loss {rows[-1]['val_loss']:.4f}",
                  flush=True)
            (out / "asynchrony.json").write_text(json.dumps(rows, indent=2))
    lines = table(rows)
    print("\n".join(lines))
    (out / "asynchrony.md").write_text("\n".join(lines) + "\n")
    if plot(rows, out / "loss_vs_wall.png"):
        print(f"plot: {out / 'loss_vs_wall.png'}")


if __name__ == "__main__":
    main()
