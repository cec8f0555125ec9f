"""Scaling benchmark: islands against centralized training as the model grows, at a fixed codec and schedule.

Usage (from the repository root, with the package installed)::

    python benchmarks/scaling.py --out results/scaling                  # CPU: sizes xs, s, m; seeds 1234, 2
    python benchmarks/scaling.py --resume results/scaling/<stamp>       # finish it in another sitting
    python benchmarks/scaling.py --sizes m --seeds 1234,2,3,4           # the 1800-step setting, four seeds
    python benchmarks/scaling.py --sizes m --codecs topk:0.3+int2,topk:0.1+int2,topk:0.025+int2 \\
        --seeds 1234                                                    # the bytes trade-off curve at one size
    python benchmarks/scaling.py --gpu --out results/scaling_gpu        # one lent GPU: the larger ladder
    python benchmarks/scaling.py --dry-run                              # the runs, their steps and tokens

Every run is one ``python -m lightning_islands.app.train`` subprocess of the provided MoE on the default
corpus, with the shared settings of the recipe ``quality_quick`` (``quality_gpu`` with ``--gpu``); per
size and seed:

- ``<size>_centralized_s<seed>``: FSDP2 over 2 processes x batch 16 (one process x 32 on a GPU): 32
  windows per step, as many as the islands together;
- ``<size>_islands_<codec>_s<seed>``: the default two heterogeneous islands (2 x 8 and 1 x 16; two
  1 x 16 islands sharing the GPU with ``--gpu``), the same codec, H and outer settings at every size
  (``--codecs``, ``--H``, ``--islands``).

**The tokens-per-parameter rule**: every size of a ladder trains the same number of tokens per
*active* parameter, that of its reference size at ``--ref-steps`` (default 1800): on CPU the
1800-step setting of the 3.4M-parameter MoE (``m``: 1800 steps x 32 x 128 tokens over 1,086,592
active parameters = 6.79), on a GPU ``g2`` (1800 x 32 x 256 over 10,738,560 = 1.37); a size's steps
are ``round(ref_steps x active / active of the reference size)``. The recipe's learning-rate
schedule (warm-up 30 steps on CPU, 100 on a GPU, then cosine to 0.1x over the run's steps) and the
islands' H stay as they are, so a smaller model also has fewer rounds. Training compute is counted
as ``6 x active parameters x tokens``.

Writes into the results folder: ``scaling.md`` (one row per run, one per size and codec over seeds,
and the verdict on the trend), ``scaling.json``, ``loss_vs_compute.png`` (validation loss against
training compute, centralized dashed) and, with more than one codec, ``ratio_vs_bytes.png`` (loss ratio
against bytes ratio). A run whose folder holds a ``summary.json`` is reused, so ``--resume`` finishes
a table over several sittings; losses do not depend on timing, so ``--parallel 2`` changes wall
times only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality import Job, run_job  # noqa: E402  (the sibling benchmark runs one job the same way)

from lightning_islands.app.report import (  # noqa: E402
    fmt_bytes,
    headless_pyplot,
    load_run,
    markdown_table,
    val_curve,
)

WINDOWS_PER_STEP = 32  # the islands together (16 + 16) and the centralized run, every setting


@dataclass(frozen=True)
class Ladder:
    """The sizes of one setting (model overrides each), its recipe, and the runs' shapes."""

    recipe: str
    seq_len: int
    sizes: dict[str, dict[str, int]]
    reference: str  # the size whose steps are ``ref_steps``
    ref_steps: int
    centralized: list[str]


def _shape(d_model: int, n_layers: int, d_ff: int, head_dim: int = 32) -> dict[str, int]:
    return {"d_model": d_model, "n_layers": n_layers, "n_heads": d_model // head_dim, "d_ff": d_ff}


LADDERS = {
    # the provided MoE's CPU preset is ``m``; width and depth grow together (d_model = 32 x n_layers)
    "cpu": Ladder("quality_quick", 128,
                  {"xs": _shape(64, 2, 128), "s": _shape(96, 3, 192), "m": _shape(128, 4, 256),
                   "l": _shape(160, 5, 320)},
                  reference="m", ref_steps=1800,
                  centralized=["strategy=fsdp", "strategy.devices=2", "data.batch_size=16"]),
    # one GPU: every run is one process per island; ``g2`` is the preset moe_gpu_small
    "gpu": Ladder("quality_gpu", 256,
                  {"g1": _shape(256, 4, 384, 64), "g2": _shape(384, 6, 512, 64), "g3": _shape(512, 8, 768, 64)},
                  reference="g2", ref_steps=1800,
                  centralized=["strategy=single", "data.batch_size=32"]),
}

# The islands' settings at every size: those of parity at 1/1024 of the bytes over four seeds at the
# 1800-step setting (docs/BENCHMARKS.md, "About 1/1000 of the bytes"); the momentum warm-up spans 10
# rounds at every size, the whole run of the smallest.
DEFAULT_ISLANDS = ["islands.sync_every=24", "islands.outer_lr=0.7", "islands.outer_momentum=0.7",
                   "islands.outer_momentum_warmup=10", "islands.error_feedback_decay=0.8",
                   "islands.expert_weighting=true", "data.shard_layout=contiguous"]
DEFAULT_CODEC = "topk:0.1+int2"


def active_parameters(size: dict[str, int], seq_len: int) -> tuple[int, int]:
    """(total, active) parameters of the provided MoE (8 experts, top 2, byte vocabulary) at ``size``."""
    import torch

    from lightning_islands.models.moe import MoEConfig, MoETransformer, count_parameters

    with torch.device("meta"):
        model = MoETransformer(MoEConfig(vocab_size=256, seq_len=seq_len, n_experts=8, top_k=2, **size))
    counts = count_parameters(model)
    return counts["total"], counts["active"]


@dataclass
class SizeRun:
    """One size of the ladder: its shape, parameters and the steps the rule gives it."""

    name: str
    overrides: list[str]
    total: int
    active: int
    steps: int
    seq_len: int

    @property
    def tokens(self) -> int:
        """Tokens the run trains: steps x the windows of a step x their length."""
        return self.steps * WINDOWS_PER_STEP * self.seq_len


def sizes_of(ladder: Ladder, names: list[str], ref_steps: int) -> list[SizeRun]:
    """The chosen sizes with their steps: equal tokens per active parameter to the reference size's."""
    unknown = [n for n in names if n not in ladder.sizes]
    if unknown:
        raise SystemExit(f"unknown size(s) {', '.join(unknown)}: this setting has {', '.join(ladder.sizes)}")
    _, ref_active = active_parameters(ladder.sizes[ladder.reference], ladder.seq_len)
    out = []
    for name in names:
        shape = ladder.sizes[name]
        total, active = active_parameters(shape, ladder.seq_len)
        steps = max(1, round(ref_steps * active / ref_active))
        overrides = [f"model.{k}={v}" for k, v in shape.items()]
        out.append(SizeRun(name, overrides, total, active, steps, seq_len=ladder.seq_len))
    return out


def plan(ladder: Ladder, sizes: list[SizeRun], seeds: list[int], codecs: list[str], islands: list[str],
         extra: list[str]) -> list[Job]:
    """Per seed and size: the centralized run and one islands run per codec."""
    jobs = []
    for seed in seeds:
        for size in sizes:
            common = [f"experiment={ladder.recipe}", *size.overrides, f"trainer.max_steps={size.steps}",
                      f"trainer.val_check_interval={max(1, size.steps // 6)}",
                      f"trainer.checkpoint_every_n_steps={size.steps}"]
            configs = [Job(f"{size.name}_centralized", "centralized", list(ladder.centralized))]
            configs += [Job(f"{size.name}_islands_{codec}", "islands",
                            ["strategy=islands", f"islands.codec={codec}", *islands], codec=codec)
                        for codec in codecs]
            for job in configs:
                job.seed, job.config = seed, job.name
                job.name = f"{job.name}_s{seed}"
                job.overrides = [*common, *job.overrides, *extra, f"seed={seed}", f"hydra.run.dir=runs/{job.name}"]
                job.metrics = {"size": size.name, "total_parameters": size.total,
                               "active_parameters": size.active, "steps": size.steps, "tokens": size.tokens,
                               "tokens_per_active_parameter": size.tokens / size.active,
                               "compute_flops": 6 * size.active * size.tokens}
            jobs.extend(configs)
    return jobs


def score(jobs: list[Job]) -> list[dict[str, Any]]:
    """One row per finished islands run: its loss against the centralized run of its size and seed,
    its bytes against synchronous data parallelism's (``steps x 2 x 4 x total parameters``)."""
    central = {(j.metrics["size"], j.seed): j.record.val_loss for j in jobs
               if j.kind == "centralized" and j.record is not None}
    rows = []
    for job in jobs:
        if job.kind != "islands" or job.record is None:
            continue
        m, r = job.metrics, job.record
        c = central.get((m["size"], job.seed))
        dp = m["steps"] * 2 * 4 * m["total_parameters"]
        rows.append({**m, "run": job.name, "seed": job.seed, "codec": job.codec, "centralized_loss": c,
                     "islands_loss": r.val_loss, "ratio": None if c is None else r.val_loss / c,
                     "bytes": r.bytes_exchanged, "sync_dp_bytes": dp,
                     "bytes_ratio": dp / r.bytes_exchanged if r.bytes_exchanged else None,
                     "rounds": r.rounds, "wall_seconds": r.wall_seconds})
    return rows


def over_seeds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per size and codec: the mean loss ratio over seeds, its lowest and highest, and the bytes ratio."""
    out = []
    for key in dict.fromkeys((r["size"], r["codec"]) for r in rows):
        same = [r for r in rows if (r["size"], r["codec"]) == key and r["ratio"] is not None]
        if not same:
            continue
        ratios = [r["ratio"] for r in same]
        out.append({"size": key[0], "codec": key[1], "seeds": [r["seed"] for r in same],
                    "active_parameters": same[0]["active_parameters"], "tokens": same[0]["tokens"],
                    "ratio_mean": sum(ratios) / len(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                    "centralized_mean": sum(r["centralized_loss"] for r in same) / len(same),
                    "islands_mean": sum(r["islands_loss"] for r in same) / len(same),
                    "bytes_ratio": _mean([r["bytes_ratio"] for r in same if r["bytes_ratio"]])})
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def verdict(summary: list[dict[str, Any]], codec: str) -> str:
    """The issue's targets for one codec: ratio <= 1 at every size, and the largest size's mean ratio at
    most the smallest size's plus the seeds' spread (the widest lowest-to-highest range of any size)."""
    ladder = sorted((s for s in summary if s["codec"] == codec), key=lambda s: s["active_parameters"])
    if len(ladder) < 2:
        return f"{codec}: fewer than two sizes finished, no trend to judge."
    spread = max(s["ratio_max"] - s["ratio_min"] for s in ladder)
    small, large = ladder[0], ladder[-1]
    at_parity = [s["size"] for s in ladder if s["ratio_mean"] <= 1.0]
    grows = large["ratio_mean"] > small["ratio_mean"] + spread
    return (f"{codec}: mean ratio at or below 1.00 at {len(at_parity)} of {len(ladder)} sizes "
            f"({', '.join(at_parity) or 'none'}); largest size {large['ratio_mean']:.4f} against smallest "
            f"{small['ratio_mean']:.4f} + spread {spread:.4f}: "
            f"{'grows with size' if grows else 'does not grow with size'}.")


def _f(x: float | None, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def tables(rows: list[dict[str, Any]], summary: list[dict[str, Any]]) -> str:
    per_run = markdown_table(
        ["size", "active params", "steps", "tokens", "codec", "seed", "centralized", "islands", "ratio",
         "islands bytes", "x fewer than sync DP"],
        [[r["size"], f"{r['active_parameters']:,}", str(r["steps"]), f"{r['tokens']:,}", r["codec"], str(r["seed"]),
          _f(r["centralized_loss"], ".4f"), _f(r["islands_loss"], ".4f"), _f(r["ratio"], ".4f"),
          fmt_bytes(r["bytes"]), _f(r["bytes_ratio"], ".0f")] for r in rows])
    per_size = markdown_table(
        ["size", "active params", "codec", "seeds", "centralized (mean)", "islands (mean)",
         "ratio mean (lowest – highest)", "x fewer than sync DP"],
        [[s["size"], f"{s['active_parameters']:,}", s["codec"], str(len(s["seeds"])), f"{s['centralized_mean']:.4f}",
          f"{s['islands_mean']:.4f}", f"{s['ratio_mean']:.4f} ({s['ratio_min']:.4f} – {s['ratio_max']:.4f})",
          _f(s["bytes_ratio"], ".0f")] for s in summary])
    return f"## Every run\n\n{per_run}\n\n## Per size and codec, over seeds\n\n{per_size}\n"


def plot_loss_vs_compute(jobs: list[Job], path: Path) -> bool:
    """Validation loss against training compute (6 x active x tokens), one line per run."""
    runs = [j for j in jobs if j.record is not None]
    if not runs:
        return False
    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for job in runs:
        points = val_curve(job.record, "tokens")
        if not points:
            continue
        flops = [6 * job.metrics["active_parameters"] * t for t, _ in points]
        ax.plot(flops, [loss for _, loss in points], marker="o", markersize=3,
                linestyle="--" if job.kind == "centralized" else "-", label=job.name)
    ax.set_title("islands (solid) against centralized (dashed) across sizes")
    _finish(plt, fig, ax, path, "training compute, 6 x active parameters x tokens (FLOPs, log scale)",
            "validation loss (global model)", 6)
    return True


def _finish(plt: Any, fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, legend: int) -> None:
    """Log x axis, labels, grid and legend; written to ``path``."""
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=legend)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ratio_vs_bytes(summary: list[dict[str, Any]], path: Path) -> bool:
    """Loss ratio (mean over seeds, with its range) against bytes ratio, one line per size."""
    if len({s["codec"] for s in summary}) < 2:
        return False
    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for size in dict.fromkeys(s["size"] for s in summary):
        pts = sorted((s for s in summary if s["size"] == size and s["bytes_ratio"]), key=lambda s: s["bytes_ratio"])
        xs = [s["bytes_ratio"] for s in pts]
        ys = [s["ratio_mean"] for s in pts]
        err = [[s["ratio_mean"] - s["ratio_min"] for s in pts], [s["ratio_max"] - s["ratio_mean"] for s in pts]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"size {size}")
        for s in pts:
            ax.annotate(s["codec"], (s["bytes_ratio"], s["ratio_mean"]), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")
    ax.axhline(1.0, linestyle="--", linewidth=1, color="grey")
    _finish(plt, fig, ax, path, "x fewer bytes than synchronous data parallelism (log scale)",
            "validation loss, islands / centralized", 7)
    return True


def _differs(job: Job, run_dir: Path) -> str:
    """The first of ``job``'s overrides a finished run's ``job.yaml`` does not hold ("" if it holds all)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / "job.yaml")
    for item in job.overrides:
        key, _, value = item.partition("=")
        if key.startswith("hydra.") or key in ("experiment", "strategy") or "." not in key:
            continue
        held = OmegaConf.select(cfg, key, default=None)
        if str(held).lower() != value.lower():
            return f"{key}={held}"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="the GPU ladder (g1, g2, g3) on one GPU")
    parser.add_argument("--sizes", default=None, help="comma-separated sizes (default: xs,s,m; with --gpu g1,g2,g3)")
    parser.add_argument("--seeds", default="1234,2", help="comma-separated seeds (default 1234,2)")
    parser.add_argument("--ref-steps", type=int, default=None,
                        help="steps of the reference size (m, or g2 with --gpu; default 1800); every size "
                             "trains the same tokens per active parameter")
    parser.add_argument("--codecs", default=DEFAULT_CODEC,
                        help=f"comma-separated islands codecs, one islands run each (default {DEFAULT_CODEC})")
    parser.add_argument("--islands", action="append", default=None, metavar="KEY=VALUE",
                        help="the islands' settings at every size, replacing the default "
                             f"({' '.join(DEFAULT_ISLANDS)}) (repeatable)")
    parser.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override passed to every run (repeatable)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (losses do not depend on it)")
    parser.add_argument("--out", default="results/scaling", help="parent of the timestamped results folder")
    parser.add_argument("--resume", default=None, metavar="DIR",
                        help="finish an earlier results folder: runs with a summary.json are reused")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and exit")
    args = parser.parse_args(argv)

    ladder = LADDERS["gpu" if args.gpu else "cpu"]
    names = args.sizes.split(",") if args.sizes else [n for n in ladder.sizes if n != "l"]
    sizes = sizes_of(ladder, names, args.ref_steps or ladder.ref_steps)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    codecs = [c for c in args.codecs.split(",") if c]
    jobs = plan(ladder, sizes, seeds, codecs, args.islands or DEFAULT_ISLANDS, args.extra)
    if args.dry_run:
        for s in sizes:
            print(f"{s.name}: {s.total:,} parameters ({s.active:,} active), {s.steps} steps, {s.tokens:,} tokens "
                  f"({s.tokens / s.active:.2f} per active parameter)")
        for job in jobs:
            print(f"{job.name}: python -m lightning_islands.app.train {shlex.join(job.overrides)}")
        return 0

    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    workdir = (Path(args.resume) if args.resume else Path(args.out) / stamp).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "benchmarks/scaling.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"[scaling] {len(jobs)} runs ({', '.join(f'{s.name}: {s.steps} steps' for s in sizes)}); "
          f"results in {workdir}", flush=True)
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        list(pool.map(lambda j: run_job(j, workdir, env), jobs))
    for job in jobs:
        summary_path = workdir / "runs" / job.name / "summary.json"
        if summary_path.exists():
            job.record = load_run(summary_path, root=workdir / "runs", label=job.name)
            stale = _differs(job, workdir / "runs" / job.name)
            if stale:
                raise SystemExit(f"{summary_path.parent} was run with {stale}, not with this command's settings: "
                                 "resume with the command that made it, or give a new --out")
    rows = score(jobs)
    summary = over_seeds(rows)
    verdicts = [verdict(summary, c) for c in codecs]
    machine = f"{platform.node() or 'host'}: {os.cpu_count()} CPU cores, {platform.system()} {platform.machine()}"
    rule = (f"Every size trains {sizes[0].tokens / sizes[0].active:.2f} tokens per active parameter (the "
            f"reference size {ladder.reference} at {args.ref_steps or ladder.ref_steps} steps).")
    text = (f"# Scaling: islands against centralized training across sizes\n\nCommand: `{command}`\n\n"
            f"Date: {dt.date.today()}; machine: {machine}. {rule} Islands: {' '.join(args.islands or DEFAULT_ISLANDS)}"
            f"{' ' + ' '.join(args.extra) if args.extra else ''}.\n\n{tables(rows, summary)}\n"
            + "".join(f"- {v}\n" for v in verdicts))
    (workdir / "scaling.md").write_text(text)
    results = {"command": command, "date": str(dt.date.today()), "machine": machine, "rule": rule,
               "islands": args.islands or DEFAULT_ISLANDS, "extra": args.extra, "codecs": codecs, "seeds": seeds,
               "sizes": [{"name": s.name, "total_parameters": s.total, "active_parameters": s.active,
                          "steps": s.steps, "tokens": s.tokens} for s in sizes],
               "rows": rows, "over_seeds": summary, "verdicts": verdicts,
               "failed": [j.name for j in jobs if j.record is None]}
    (workdir / "scaling.json").write_text(json.dumps(results, indent=2))
    try:
        plot_loss_vs_compute(jobs, workdir / "loss_vs_compute.png")
        plot_ratio_vs_bytes(summary, workdir / "ratio_vs_bytes.png")
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'lightning-islands[plot]')")
    print(text)
    print(f"[scaling] wrote {workdir}/scaling.md, scaling.json")
    if results["failed"]:
        print(f"[scaling] failed runs: {', '.join(results['failed'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
