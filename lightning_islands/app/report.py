"""``lightning-islands report RUNS_DIR``: one table (and two plots) from a folder of finished runs.

Every ``summary.json`` under ``RUNS_DIR`` (searched recursively, so single runs, multirun sweeps and
benchmark folders all work) is one row. The row's settings come from the run's ``job.yaml`` (the
resolved config the driver wrote), its results from ``summary.json``, and its curves and rounds from
the run's own history (``island*/history.jsonl``, whatever the logger; older runs: island 0's CSV log).

Written to ``--out`` (default ``RUNS_DIR/report``):

- ``report.md``: a markdown table, one row per run, with the ratio of its final validation loss to
  the centralized baseline when the set has one (a run of strategy ``fsdp``, ``single`` or ``ddp``;
  with several, the one that trains the most tokens per step, or the one named by ``--baseline``);
- ``report.csv``: the same rows with every setting in its own column;
- ``val_loss_vs_tokens.png``, ``val_loss_vs_time.png`` and ``loss_vs_bytes.png`` (matplotlib, a
  dependency of the package), centralized runs dashed beside the islands;
- ``rounds_<run>.png`` for each islands run: bytes per round, where each island's round time went
  (compute, exchange, wait) and membership over time.

``lightning-islands train`` writes the same for each run it finishes, into ``RUN_DIR/report``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lightning_islands.app.history import run_histories
from lightning_islands.app.round_plots import plot_rounds, val_points

CENTRALIZED = ("fsdp", "single", "ddp")
# Columns of report.md: (header, attribute of RunRecord or "ratio").
MD_COLUMNS = [("run", "name"), ("setup", "label"), ("steps", "max_steps"), ("val loss", "val_loss"),
              ("vs baseline", "ratio"), ("tokens", "tokens"), ("bytes exchanged", "bytes_exchanged"),
              ("wall s", "wall_seconds")]


@dataclass
class RunRecord:
    """One finished run: the settings that tell runs apart, and what came out."""

    name: str  # the run folder relative to the reported folder
    run_dir: str
    experiment: str
    strategy: str
    label: str  # compact human description of the settings
    sync_every: int | None = None
    sync_warmup: list[int] | None = None  # H of the first rounds, if any
    codec: str | None = None
    error_feedback: bool | None = None
    error_feedback_decay: float = 1.0  # share of the residual carried into the next round
    outer_lr: float | None = None
    outer_momentum: float | None = None
    outer_lr_warmup: int = 0  # rounds of linear warm-up of the outer lr (0: none)
    outer_momentum_warmup: int = 0  # rounds of linear warm-up of the outer momentum (0: none)
    expert_weighting: bool | None = None
    shard_layout: str | None = None  # how the corpus is split between islands and ranks
    members: str = ""  # "2x8+1x16": processes x batch per island (or the one world)
    batch_size: int | None = None
    max_steps: int | None = None
    global_step: int | None = None
    val_loss: float = math.nan
    val_ppl: float = math.nan
    tokens: int = 0
    tokens_per_step: float = 0.0
    bytes_exchanged: float = 0.0
    rounds: int | None = None
    wall_seconds: float = math.nan
    parameters: int | None = None
    ratio: float | None = None  # val_loss / the baseline's, filled by attach_baseline
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def centralized(self) -> bool:
        """True for a run without islands (the candidates for the baseline)."""
        return self.strategy in CENTRALIZED

    def row(self) -> dict[str, Any]:
        """Flat dict for the CSV (``extra`` is folded in)."""
        d = asdict(self)
        extra = d.pop("extra")
        d.update(extra)
        return d


def _natural_key(path: Path) -> list[tuple[int, int | str]]:
    """Sort key that orders digit runs by value: a multirun's job 2 before job 10."""
    return [(0, int(tok)) if tok.isdigit() else (1, tok) for tok in re.split(r"(\d+)", str(path)) if tok]


def find_summaries(runs_dir: str | Path) -> list[Path]:
    """Every ``summary.json`` under ``runs_dir`` (recursively), sorted by path (numbers by value,
    so a multirun's jobs come in job order)."""
    root = Path(runs_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder")
    return sorted(root.rglob("summary.json"), key=_natural_key)


def _members(job: Any, strategy: str) -> tuple[str, int | None]:
    """``"2x8+1x16"`` and the batch size per process (the only one, or None when islands differ)."""
    if strategy == "islands":
        members = list(job.islands.members)
        sizes = [int(m.get("batch_size") or job.data.batch_size) for m in members]
        text = "+".join(f"{int(m.devices)}x{b}" for m, b in zip(members, sizes))
        return text, sizes[0] if len(set(sizes)) == 1 else None
    devices = int(job.strategy.get("devices", 1) or 1)
    batch = int(job.data.batch_size)
    return f"{devices}x{batch}", batch


def describe(record: RunRecord) -> str:
    """The compact label of a run: strategy, layout and, for islands, H, codec and outer optimizer;
    then the settings that are off their defaults (a contiguous data split, expert weighting)."""
    data = " contiguous" if record.shard_layout == "contiguous" else ""
    if record.strategy != "islands":
        return f"{record.strategy} {record.members}{data}"
    codec = record.codec or "?"
    if record.error_feedback is False:
        codec += " no-EF"
    elif record.error_feedback is True:
        codec += " EF"
    if record.error_feedback_decay != 1.0:
        codec += f" EF-decay {record.error_feedback_decay:g}"
    h = f"{record.sync_every}"
    if record.sync_warmup:
        h = f"{','.join(map(str, record.sync_warmup))}->{h}"
    experts = " expert-weighted" if record.expert_weighting else ""
    lr = _with_warmup(record.outer_lr, record.outer_lr_warmup)
    m = _with_warmup(record.outer_momentum, record.outer_momentum_warmup)
    return f"islands {record.members} H={h} {codec} lr={lr} m={m}{experts}{data}"


def _with_warmup(value: float | None, rounds: int) -> str:
    """An outer hyper-parameter for a label, with its warm-up in rounds when it has one."""
    return f"{value:g}" + (f" (warm-up {rounds})" if rounds else "")


def load_run(summary_path: str | Path, root: str | Path | None = None, label: str | None = None) -> RunRecord:
    """Read one run folder (its ``summary.json`` and ``job.yaml``) into a :class:`RunRecord`."""
    summary_path = Path(summary_path)
    run_dir = summary_path.parent
    summary = json.loads(summary_path.read_text())
    job_path = run_dir / "job.yaml"
    job = OmegaConf.load(job_path) if job_path.exists() else OmegaConf.create({})
    strategy = str(summary.get("strategy") or OmegaConf.select(job, "strategy.name", default="?"))
    try:
        name = str(run_dir.relative_to(root)) if root is not None else run_dir.name
    except ValueError:
        name = str(run_dir)
    islands = summary.get("islands") or []
    tokens_per_step = sum(r["tokens"] / r["global_step"] for r in islands if r.get("global_step"))
    members, batch = ("", None)
    if "strategy" in job and "data" in job:
        members, batch = _members(job, strategy)
    params = summary.get("parameters") or {}
    rec = RunRecord(
        name=name or ".", run_dir=str(run_dir),
        experiment=str(OmegaConf.select(job, "experiment.name", default="?")),
        strategy=strategy, label="", members=members, batch_size=batch,
        max_steps=OmegaConf.select(job, "trainer.max_steps", default=None),
        global_step=islands[0].get("global_step") if islands else None,
        val_loss=float(summary["val_loss"]), val_ppl=float(summary.get("val_ppl", math.nan)),
        tokens=int(summary.get("tokens", 0)), tokens_per_step=tokens_per_step,
        bytes_exchanged=float(summary.get("bytes_exchanged", 0.0) or 0.0), rounds=summary.get("rounds"),
        wall_seconds=float(summary.get("wall_seconds", math.nan)), parameters=params.get("total"),
    )
    rec.shard_layout = OmegaConf.select(job, "data.shard_layout", default=None)
    if strategy == "islands":
        rec.expert_weighting = OmegaConf.select(job, "islands.expert_weighting", default=None)
        rec.sync_every = OmegaConf.select(job, "islands.sync_every", default=None)
        warmup = OmegaConf.select(job, "islands.sync_warmup", default=None)
        rec.sync_warmup = [int(h) for h in warmup] if warmup else None
        rec.codec = OmegaConf.select(job, "islands.codec", default=None)
        rec.error_feedback = OmegaConf.select(job, "islands.error_feedback", default=None)
        decay = OmegaConf.select(job, "islands.error_feedback_decay", default=None)
        rec.error_feedback_decay = 1.0 if decay is None else float(decay)
        rec.outer_lr = OmegaConf.select(job, "islands.outer_lr", default=None)
        rec.outer_momentum = OmegaConf.select(job, "islands.outer_momentum", default=None)
        rec.outer_lr_warmup = int(OmegaConf.select(job, "islands.outer_lr_warmup", default=0) or 0)
        rec.outer_momentum_warmup = int(OmegaConf.select(job, "islands.outer_momentum_warmup", default=0) or 0)
    rec.label = label or describe(rec)
    return rec


def load_runs(runs_dir: str | Path) -> list[RunRecord]:
    """Every finished run under ``runs_dir``; raises ``FileNotFoundError`` naming the folder if none."""
    summaries = find_summaries(runs_dir)
    if not summaries:
        raise FileNotFoundError(f"no summary.json under {Path(runs_dir).resolve()}: no finished run there "
                                "(each `lightning-islands train` run writes one at the end)")
    return [load_run(p, root=runs_dir) for p in summaries]


def pick_baseline(records: Sequence[RunRecord], name: str | None = None) -> RunRecord | None:
    """The centralized baseline: the run whose folder or label contains ``name``; else the centralized
    run with the most tokens per step (lowest loss among equals); None if the set has none."""
    if name is not None:
        hits = [r for r in records if name in r.name or name in r.label]
        if not hits:
            raise ValueError(f"no run matches --baseline {name!r}; runs: {', '.join(r.name for r in records)}")
        return hits[0]
    central = [r for r in records if r.centralized]
    if not central:
        return None
    return min(central, key=lambda r: (-r.tokens_per_step, r.val_loss))


def attach_baseline(records: Sequence[RunRecord], baseline: RunRecord | None) -> None:
    """Fill each record's ``ratio`` (final val loss over the baseline's)."""
    for r in records:
        r.ratio = r.val_loss / baseline.val_loss if baseline is not None else None


def fmt(value: Any) -> str:
    """Format one table cell: losses with 4 decimals, bytes in MB, big counts with separators."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def fmt_bytes(value: float | None) -> str:
    """Bytes as MB (``0`` for runs that exchange nothing)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return "0" if value == 0 else f"{value / 1e6:,.1f} MB"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table; numeric-looking columns are right-aligned."""
    def numeric(col: int) -> bool:
        cells = [r[col] for r in rows if r[col] not in ("—", "")]
        return bool(cells) and all(c.replace(",", "").replace(".", "").replace(" MB", "").replace("-", "")
                                   .replace("x", "").strip().isdigit() for c in cells)

    align = ["---:" if numeric(i) else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def report_table(records: Sequence[RunRecord]) -> str:
    """The markdown table of ``report.md``."""
    rows = []
    for r in records:
        cells = []
        for _, attr in MD_COLUMNS:
            value = getattr(r, attr)
            if attr == "bytes_exchanged":
                cells.append(fmt_bytes(value))
            elif attr == "ratio":
                cells.append("—" if value is None else f"{value:.3f}")
            elif attr == "wall_seconds":
                cells.append(f"{value:.1f}" if not math.isnan(value) else "—")
            else:
                cells.append(fmt(value))
        rows.append(cells)
    return markdown_table([h for h, _ in MD_COLUMNS], rows)


def write_csv(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Write dict rows (the union of their keys, in first-seen order) as CSV."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with Path(path).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})


def val_curve(record: RunRecord, by: str = "tokens") -> list[tuple[float, float]]:
    """(tokens of all islands, or seconds since the start with ``by="time"``; val loss) of island 0,
    from the run's own history (``island*/history.jsonl``, whatever the logger); runs written
    before it existed fall back to the CSV log (tokens only). Empty without either."""
    points = val_points(run_histories(record.run_dir))
    if points:
        return [((tokens if by == "tokens" else t), loss) for tokens, t, loss in points]
    return _csv_val_curve(record) if by == "tokens" else []


def _csv_val_curve(record: RunRecord) -> list[tuple[float, float]]:
    """Island 0's CSV log: Lightning logs validation inside ``fit`` at ``global_step - 1`` (its step
    counter moves after the validation hook) and the final ``validate`` at ``global_step``: both
    are mapped to the optimizer steps done, and the last value for each wins."""
    path = Path(record.run_dir) / "logs" / "island0" / "metrics.csv"
    if not path.exists() or not record.tokens_per_step:
        return []
    done: dict[int, float] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            if not row.get("val/loss") or not row.get("step"):
                continue
            step = int(float(row["step"]))
            steps_done = step if record.global_step is not None and step >= record.global_step else step + 1
            done[steps_done] = float(row["val/loss"])
    return [(s * record.tokens_per_step, loss) for s, loss in sorted(done.items())]


def headless_pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_val_loss(records: Sequence[RunRecord], path: str | Path, by: str = "tokens",
                  title: str | None = None) -> bool:
    """Validation loss of island 0 against the tokens all islands trained (``by="tokens"``) or wall
    time (``by="time"``), one line per run, centralized ones dashed; False when no run has a curve."""
    curves = [(r, val_curve(r, by)) for r in records]
    if not any(points for _, points in curves):
        return False
    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for r, points in curves:
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", markersize=3, linestyle="--" if r.centralized else "-", label=r.label)
    ax.set_xlabel("tokens trained (all islands)" if by == "tokens" else "seconds since the start of training")
    ax.set_ylabel("validation loss (global model)")
    ax.set_title(title or f"validation loss vs {'tokens' if by == 'tokens' else 'wall time'}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_val_loss_vs_tokens(records: Sequence[RunRecord], path: str | Path, title: str | None = None) -> bool:
    """:func:`plot_val_loss` against tokens."""
    return plot_val_loss(records, path, "tokens", title)


def plot_val_loss_vs_time(records: Sequence[RunRecord], path: str | Path, title: str | None = None) -> bool:
    """:func:`plot_val_loss` against wall time."""
    return plot_val_loss(records, path, "time", title)


def plot_loss_vs_bytes(records: Sequence[RunRecord], path: str | Path, title: str | None = None) -> bool:
    """Final validation loss against cross-island bytes (log x); runs that exchange nothing (centralized
    or one island alone) are horizontal reference lines."""
    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    exchanged = [r for r in records if r.bytes_exchanged > 0]
    for r in exchanged:
        ax.scatter([r.bytes_exchanged], [r.val_loss], s=30)
        ax.annotate(r.label, (r.bytes_exchanged, r.val_loss), fontsize=7, xytext=(4, 3), textcoords="offset points")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(r for r in records if r.bytes_exchanged <= 0):
        ax.axhline(r.val_loss, linestyle="--", linewidth=1, color=colors[i % len(colors)],
                   label=f"{r.label} (no exchange) {r.val_loss:.4f}")
    if exchanged:
        ax.set_xscale("log")
        xs = [r.bytes_exchanged for r in exchanged]
        ax.set_xlim(min(xs) / 1.6, max(xs) * 4)  # room for the labels right of the points
    ax.set_xlabel("bytes exchanged between islands (sum over islands, log scale)")
    ax.set_ylabel("final validation loss")
    ax.set_title(title or "final validation loss vs cross-island bytes")
    ax.grid(alpha=0.3, which="both")
    if any(r.bytes_exchanged <= 0 for r in records):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


@dataclass
class Report:
    """What :func:`build_report` wrote."""

    records: list[RunRecord]
    baseline: RunRecord | None
    table: str
    out: Path
    plots: list[Path]


def build_report(runs_dir: str | Path, out: str | Path | None = None, baseline: str | None = None,
                 plots: bool = True) -> Report:
    """Read every run under ``runs_dir`` and write report.md, report.csv and the plots to ``out``."""
    runs_dir = Path(runs_dir)
    records = load_runs(runs_dir)
    base = pick_baseline(records, baseline)
    attach_baseline(records, base)
    out_dir = Path(out) if out is not None else runs_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    table = report_table(records)
    note = (f"Baseline: `{base.name}` ({base.label}), val loss {base.val_loss:.4f}." if base is not None
            else "No centralized run (strategy fsdp, single or ddp) in this folder: no ratio column.")
    (out_dir / "report.md").write_text(f"# Runs under {runs_dir}\n\n{table}\n\n{note}\n")
    write_csv([r.row() for r in records], out_dir / "report.csv")
    written: list[Path] = []
    if plots:
        plotters = ((plot_val_loss_vs_tokens, "val_loss_vs_tokens.png"),
                    (plot_val_loss_vs_time, "val_loss_vs_time.png"), (plot_loss_vs_bytes, "loss_vs_bytes.png"))
        for fn, file in plotters:
            if fn(records, out_dir / file):
                written.append(out_dir / file)
        for r in records:  # each islands run: its rounds (bytes, where the time went, membership)
            safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", r.name)
            file = out_dir / ("rounds.png" if r.name == "." else f"rounds_{safe}.png")
            if not r.centralized and plot_rounds(run_histories(r.run_dir), file, r.label):
                written.append(file)
    return Report(records=records, baseline=base, table=table, out=out_dir, plots=written)


def main(argv: list[str] | None = None) -> int:
    """``lightning-islands report RUNS_DIR [--out DIR] [--baseline NAME] [--no-plots]``."""
    parser = argparse.ArgumentParser(prog="lightning-islands report",
                                     description="Tabulate (and plot) every finished run under a folder.")
    parser.add_argument("runs_dir", help="folder searched recursively for summary.json, e.g. runs/sweep_h")
    parser.add_argument("--out", default=None, help="where to write the report (default RUNS_DIR/report)")
    parser.add_argument("--baseline", default=None,
                        help="the run to compare against (a substring of its folder or label); default: the "
                             "centralized run with the most tokens per step")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    args = parser.parse_args(argv)
    try:
        rep = build_report(args.runs_dir, args.out, baseline=args.baseline, plots=not args.no_plots)
    except (FileNotFoundError, ValueError) as exc:
        print(f"lightning-islands report: {exc}", file=sys.stderr)
        return 1
    print(rep.table)
    print()
    if rep.baseline is not None:
        print(f"baseline: {rep.baseline.name} ({rep.baseline.label}), val loss {rep.baseline.val_loss:.4f}")
    print(f"report written to {rep.out}" + (f" ({', '.join(p.name for p in rep.plots)})" if rep.plots else ""))
    return 0
