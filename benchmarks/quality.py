"""Quality benchmark: two heterogeneous islands against centralized training, at equal tokens.

Usage (from the repository root, with the package installed)::

    python benchmarks/quality.py --quick --parallel 2          # the default setting, ~20-30 min on 2 cores
    python benchmarks/quality.py --H 25,50,100 --codecs fp32,int4,int2
    python benchmarks/quality.py --large                       # hours on 2 cores: for a bigger machine
    python benchmarks/quality.py --gpu --H 24 --codecs topk:0.1+int2,fp32 --parallel 4   # one GPU
    python benchmarks/quality.py --extra model=dense_cpu --extra seed=7
    python benchmarks/quality.py --seeds 1234,2 --H 10      # every run once per seed, plus mean/spread

Every run is one ``python -m lightning_islands.app.train`` subprocess of the provided MoE on the default
corpus (the standard library's source), with the shared settings of the recipe ``quality_quick``
(or ``quality_large``) and its own overrides:

- ``centralized``: ``strategy=fsdp strategy.devices=2 data.batch_size=16``: 32 windows per step, as
  many as the two islands together (16 + 16), so every step trains the same number of tokens;
- ``islands_H{H}_{codec}``: the default two heterogeneous islands (island 0: 2 processes x batch 8,
  island 1: 1 process x batch 16) syncing every H steps with that codec, for each H and codec;
- ``alone_island0`` (``strategy=fsdp strategy.devices=2 data.batch_size=8``) and ``alone_island1``
  (``strategy=single data.batch_size=16``): each island training by itself for the same number of
  steps (so half the tokens): what an island gets without the others.

``--gpu`` (recipe ``quality_gpu``) is the same comparison at ten times the active parameters on one
GPU. A GPU takes one NCCL rank, so every run is one process per island: ``centralized`` is
``strategy=single data.batch_size=32``, the islands are 1 x 16 and 1 x 16, and one
``alone_island`` run (``strategy=single data.batch_size=16``) stands for both equal islands;
``--parallel`` runs share the GPU.

Per run, the table reports:

- final validation loss of the global model (same validation windows for every run);
- ``vs centralized``: that loss over the centralized run's;
- ``gain recovered``: ``(alone_best - loss) / (alone_best - centralized)``, where ``alone_best`` is
  the lower loss of the two alone runs: 1 means the islands are as good as centralized training,
  0 means joining the islands bought nothing over the better island alone;
- ``cross-island bytes``: the sum over islands of bytes sent (``summary.json``'s
  ``bytes_exchanged``; it includes island 0's one-time broadcast of the initial parameters);
- ``vs sync DP``: those bytes over what synchronous data-parallel training would send across the
  same cut (the link between the two islands): every step, each island's leader sends the fp32
  gradient of all N parameters to the other, i.e. ``2 * 4 * N`` bytes per step, ``steps * 8 * N``
  in all (an all-reduce between two parties moves one full copy each way; N counts every
  parameter of the MoE, experts included).

Outputs go to ``results/quality/<timestamp>/``: ``table.md``, ``table.csv``, ``results.json``,
``val_loss_vs_tokens.png`` and ``loss_vs_bytes.png`` (via :mod:`lightning_islands.app.report`, when
matplotlib is installed), and each run's folder under ``runs/<name>/`` with its log ``runs/<name>.log``.
Losses do not depend on speed, so ``--parallel 2`` (two runs at once) changes wall times only;
wall times are then measured on a shared machine and only roughly comparable.

``--seeds S1,S2,...`` runs every configuration once per seed (names get ``_s<seed>``); each run is
compared with the centralized and alone runs of its own seed, and a second table gives, per
configuration, the mean over seeds with the lowest and highest value. At this model size two seeds
of the same centralized run differed by 2.4% in validation loss, so differences of a few percent
need several seeds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from lightning_islands.app.report import (
    RunRecord,
    fmt_bytes,
    load_run,
    markdown_table,
    plot_loss_vs_bytes,
    plot_val_loss_vs_tokens,
    write_csv,
)


@dataclass(frozen=True)
class Setting:
    """The shared recipe of a setting, its default length, and the overrides of its baseline runs."""

    recipe: str
    steps: int
    centralized: list[str]  # as many windows per step as the islands together
    alone: dict[str, list[str]]  # each distinct island by itself, at its own batch


def _cpu_setting(recipe: str, steps: int, b0: int, b1: int) -> Setting:
    """Island 0: 2 processes x ``b0``, island 1: 1 process x ``b1`` (= 2 x ``b0``), on CPU cores."""
    return Setting(recipe, steps, ["strategy=fsdp", "strategy.devices=2", f"data.batch_size={b1}"],
                   {"alone_island0": ["strategy=fsdp", "strategy.devices=2", f"data.batch_size={b0}"],
                    "alone_island1": ["strategy=single", f"data.batch_size={b1}"]})


SETTINGS = {
    "quick": _cpu_setting("quality_quick", 300, 8, 16),
    "large": _cpu_setting("quality_large", 1200, 16, 32),
    # one GPU: every run is one process (a GPU takes one NCCL rank), the two islands are equal
    "gpu": Setting("quality_gpu", 1800, ["strategy=single", "data.batch_size=32"],
                   {"alone_island": ["strategy=single", "data.batch_size=16"]}),
}


@dataclass
class Job:
    name: str
    kind: str  # centralized | islands | alone
    overrides: list[str]
    H: int | None = None
    codec: str | None = None
    returncode: int | None = None
    seconds: float = 0.0
    record: RunRecord | None = None
    metrics: dict = field(default_factory=dict)
    seed: int | None = None
    config: str = ""  # the name without the seed suffix


def plan(setting: str, steps: int, hs: list[int], codecs: list[str], extra: list[str],
         seeds: list[int] | None = None) -> list[Job]:
    """The runs of one benchmark: every configuration once per seed (``None``: the config's seed)."""
    cfg = SETTINGS[setting]
    common = [f"experiment={cfg.recipe}", f"trainer.max_steps={steps}",
              f"trainer.val_check_interval={max(1, steps // 6)}", f"trainer.checkpoint_every_n_steps={steps}"]
    jobs = []
    for seed in seeds or [None]:
        configs = []
        for h in hs:
            for codec in codecs:
                overrides = ["strategy=islands", f"islands.sync_every={h}", f"islands.codec={codec}"]
                configs.append(Job(f"islands_H{h}_{codec}", "islands", overrides, H=h, codec=codec))
        configs.append(Job("centralized", "centralized", list(cfg.centralized)))
        configs.extend(Job(name, "alone", list(overrides)) for name, overrides in cfg.alone.items())
        for job in configs:
            job.seed, job.config = seed, job.name
            if seeds:
                job.name = f"{job.name}_s{seed}"
            seeded = [f"seed={seed}"] if seed is not None else []
            job.overrides = [*common, *job.overrides, *extra, *seeded, f"hydra.run.dir=runs/{job.name}"]
        jobs.extend(configs)
    return jobs


def run_job(job: Job, workdir: Path, env: dict[str, str]) -> Job:
    run_dir = workdir / "runs" / job.name
    summary = run_dir / "summary.json"
    if summary.exists():  # --resume: a finished run is kept
        print(f"[quality] {job.name}: already done, reusing {run_dir}", flush=True)
        job.returncode = 0
        return job
    cmd = [sys.executable, "-m", "lightning_islands.app.train", *job.overrides]
    log = workdir / "runs" / f"{job.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[quality] start {job.name}: {shlex.join(cmd[1:])}", flush=True)
    started = time.time()
    with log.open("w") as f:
        job.returncode = subprocess.run(cmd, cwd=workdir, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    job.seconds = time.time() - started
    status = "done" if job.returncode == 0 and summary.exists() else f"FAILED (exit {job.returncode}, see {log})"
    print(f"[quality] {job.name}: {status} in {job.seconds:.0f} s", flush=True)
    return job


def score(jobs: list[Job], steps: int) -> dict[int | None, tuple[float | None, float | None]]:
    """Fill each job's metrics against the baselines of its own seed.

    Returns ``{seed: (centralized loss, best alone loss)}``.
    """
    baselines: dict[int | None, tuple[float | None, float | None]] = {}
    for seed in dict.fromkeys(j.seed for j in jobs):
        same = [j for j in jobs if j.seed == seed and j.record is not None]
        central = next((j.record.val_loss for j in same if j.kind == "centralized"), None)
        alone = [j.record.val_loss for j in same if j.kind == "alone"]
        alone_best = min(alone) if alone else None
        baselines[seed] = (central, alone_best)
        for job in same:
            r = job.record
            m = {"val_loss": r.val_loss, "vs_centralized": None, "gain_recovered": None,
                 "cross_island_bytes": r.bytes_exchanged, "vs_sync_dp": None}
            if central is not None:
                m["vs_centralized"] = r.val_loss / central
            if central is not None and alone_best is not None and alone_best != central:
                m["gain_recovered"] = (alone_best - r.val_loss) / (alone_best - central)
            if r.parameters and job.kind == "islands":
                dp = steps * 2 * 4 * r.parameters
                m["sync_dp_bytes"] = dp
                m["vs_sync_dp"] = r.bytes_exchanged / dp
            job.metrics = m
    return baselines


def seed_summary(jobs: list[Job]) -> tuple[str, list[dict]]:
    """Per configuration over seeds: mean (lowest, highest) of loss, ratio and gain recovered."""
    headers = ["config", "seeds", "val loss", "vs centralized", "gain recovered"]
    rows, flat = [], []
    for config in dict.fromkeys(j.config for j in jobs):
        done = [j for j in jobs if j.config == config and j.record is not None]

        def stat(key: str, spec: str, done: list[Job] = done) -> tuple[str, dict]:
            vals = [j.metrics[key] for j in done if j.metrics.get(key) is not None]
            if not vals:
                return "—", {}
            mean = sum(vals) / len(vals)
            text = f"{mean:{spec}} ({min(vals):{spec}} – {max(vals):{spec}})"
            return text, {f"{key}_mean": mean, f"{key}_min": min(vals), f"{key}_max": max(vals)}

        cells, row = [], {"config": config, "seeds": [j.seed for j in done]}
        for key, spec in (("val_loss", ".4f"), ("vs_centralized", ".3f"), ("gain_recovered", ".2f")):
            text, values = stat(key, spec)
            cells.append(text)
            row.update(values)
        rows.append([config, str(len(done)), *cells])
        flat.append(row)
    return markdown_table(headers, rows), flat


def table(jobs: list[Job]) -> tuple[str, list[dict]]:
    headers = ["run", "setup", "val loss", "vs centralized", "gain recovered", "cross-island bytes",
               "vs sync DP", "tokens", "wall s"]
    rows, flat = [], []
    for job in jobs:
        r, m = job.record, job.metrics
        if r is None:
            rows.append([job.name, "FAILED", *["—"] * (len(headers) - 2)])
            flat.append({"run": job.name, "kind": job.kind, "failed": True})
            continue

        def f(x: float | None, spec: str) -> str:
            return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

        dp = m.get("vs_sync_dp")
        rows.append([job.name, _setup(r), f(r.val_loss, ".4f"), f(m["vs_centralized"], ".3f"),
                     f(m["gain_recovered"], ".2f"),
                     fmt_bytes(r.bytes_exchanged) if job.kind == "islands" else "0",
                     f"{dp:.4f} (1/{1 / dp:.0f})" if dp else "—", f"{r.tokens:,}", f(r.wall_seconds, ".0f")])
        flat.append({"run": job.name, "kind": job.kind, "setup": r.label, "H": job.H, "codec": job.codec,
                     "seed": job.seed,
                     **m, "tokens": r.tokens, "steps": r.global_step, "parameters": r.parameters,
                     "rounds": r.rounds, "wall_seconds": r.wall_seconds, "run_dir": r.run_dir})
    return markdown_table(headers, rows), flat


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the default: 300 steps, 32 windows per step")
    size.add_argument("--large", action="store_true",
                      help="global batch 64 windows (every batch doubled) and 1200 steps: the regime closer to "
                           "where published parity lives; hours on 2 CPU cores")
    size.add_argument("--gpu", action="store_true",
                      help="one GPU: the 32M-parameter MoE (10.7M active, bf16), two equal one-process islands "
                           "(16 + 16 windows of 256 bytes), 1800 steps; runs share the GPU with --parallel")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per run (default 300, large 1200, gpu 1800)")
    parser.add_argument("--H", default="25,50", help="comma-separated sync intervals (default 25,50)")
    parser.add_argument("--codecs", default="fp32,int4", help="comma-separated codecs (default fp32,int4)")
    parser.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override passed to every run (repeatable)")
    parser.add_argument("--seeds", default=None,
                        help="comma-separated seeds: every run once per seed, compared within its seed, "
                             "plus mean and spread per configuration")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (losses do not depend on it)")
    parser.add_argument("--out", default="results/quality", help="parent of the timestamped results folder")
    parser.add_argument("--resume", default=None, metavar="DIR",
                        help="finish an earlier results folder: runs with a summary.json are reused")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and exit")
    args = parser.parse_args(argv)

    setting = "large" if args.large else "gpu" if args.gpu else "quick"
    steps = args.steps or SETTINGS[setting].steps
    hs = [int(h) for h in args.H.split(",") if h]
    codecs = [c for c in args.codecs.split(",") if c]
    seeds = [int(v) for v in args.seeds.split(",") if v] if args.seeds else None
    jobs = plan(setting, steps, hs, codecs, args.extra, seeds)
    if args.dry_run:
        for job in jobs:
            print(f"{job.name}: python -m lightning_islands.app.train {shlex.join(job.overrides)}")
        return 0

    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    workdir = Path(args.resume) if args.resume else Path(args.out) / stamp
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "benchmarks/quality.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"[quality] {len(jobs)} runs, {steps} steps each, setting {setting}, parallel {args.parallel}; "
          f"results in {workdir}", flush=True)
    env = dict(os.environ)
    env.setdefault("WANDB_MODE", "offline")
    started = time.time()
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        list(pool.map(lambda j: run_job(j, workdir, env), jobs))
    total = time.time() - started
    date = dt.datetime.now().isoformat(timespec="seconds")
    previous = workdir / "results.json"
    if args.resume and previous.exists() and all(j.seconds == 0 for j in jobs):
        # nothing was re-run: the tables are rebuilt, the record of the original run is kept
        old = json.loads(previous.read_text())
        command, date, total = old["command"], old["date"], old["total_seconds"]

    for job in jobs:
        summary = workdir / "runs" / job.name / "summary.json"
        if summary.exists():
            job.record = load_run(summary, root=workdir / "runs", label=job.name)
            if job.kind != "islands":
                job.record.label = f"{job.name} ({_setup(job.record)})"
    baselines = score(jobs, steps)
    md, flat = table(jobs)
    spread_md, spread = seed_summary(jobs) if seeds else ("", [])
    machine = f"{platform.node() or 'host'}: {os.cpu_count()} CPU cores, {platform.system()} {platform.machine()}"
    header = (f"# Quality: islands vs centralized ({setting}, {steps} steps)\n\n"
              f"Command: `{command}`\n\nDate: {date[:10]}; machine: {machine}; "
              f"total {total / 60:.1f} min with {args.parallel} run(s) at once.\n\n")
    per_seed = "; ".join(f"{'' if seed is None else f'seed {seed}: '}centralized loss {_f(c)}, best island alone "
                         f"{_f(a)}" for seed, (c, a) in baselines.items())
    notes = (f"\n\n{per_seed}. `vs sync DP` = cross-island bytes / (steps x 2 x 4 x N parameters).\n")
    if spread_md:
        notes += (f"\n## Over seeds {', '.join(map(str, seeds or []))}: mean (lowest – highest), each run compared "
                  f"with the centralized and alone runs of its own seed\n\n{spread_md}\n")
    (workdir / "table.md").write_text(header + md + notes)
    write_csv(flat, workdir / "table.csv")
    results = {"command": command, "date": date, "machine": machine,
               "setting": setting, "steps": steps, "H": hs, "codecs": codecs, "extra": args.extra,
               "parallel": args.parallel, "total_seconds": total, "seeds": seeds,
               "baselines": [{"seed": seed, "centralized_val_loss": c, "alone_best_val_loss": a}
                             for seed, (c, a) in baselines.items()],
               "over_seeds": spread,
               "runs": [{**row, "overrides": j.overrides, "returncode": j.returncode} for row, j in zip(flat, jobs)]}
    (workdir / "results.json").write_text(json.dumps(results, indent=2))
    records = [j.record for j in jobs if j.record is not None]
    plotted = plot_val_loss_vs_tokens(records, workdir / "val_loss_vs_tokens.png",
                                      title=f"quality benchmark ({setting}): validation loss vs tokens")
    plot_loss_vs_bytes(records, workdir / "loss_vs_bytes.png",
                       title=f"quality benchmark ({setting}): final validation loss vs cross-island bytes")
    print(header + md + notes)
    if not plotted:
        print("plots skipped: matplotlib is not installed (pip install 'lightning-islands[plot]')")
    print(f"[quality] wrote {workdir}/table.md, table.csv, results.json")
    failed = [j.name for j in jobs if j.record is None]
    if failed:
        print(f"[quality] failed runs: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _setup(r: RunRecord) -> str:
    return f"{r.strategy} {r.members}"


def _f(x: float | None) -> str:
    return "—" if x is None else f"{x:.4f}"


if __name__ == "__main__":
    sys.exit(main())
