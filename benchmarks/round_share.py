"""The round's share of a finished run's wall time, per island, from its logs.

For each run folder (``runs/<experiment>/<time>/``), per island: the fit's wall time
(``island{i}/result.json``), the sum over rounds of ``islands/seconds_outer_step`` (the whole outer
step, waiting for the other islands included) and of ``islands/seconds_waiting`` (from
``logs/island{i}/metrics.csv``), and the round's own share: outer step less waiting, over the fit.

    python benchmarks/round_share.py runs/default/*/ [--out results/round_share.json]
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path


def share(run: Path, island: int) -> dict:
    """One island's row for the run folder ``run``."""
    result = json.loads((run / f"island{island}" / "result.json").read_text())
    with (run / "logs" / f"island{island}" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))

    def total(key: str) -> float:
        return sum(float(r[key]) for r in rows if r.get(key))

    outer, waiting, fit = total("islands/seconds_outer_step"), total("islands/seconds_waiting"), result["fit_seconds"]
    return {"run": str(run), "island": island, "val_loss": result["val_loss"], "fit_seconds": fit,
            "rounds": result.get("rounds"), "outer_seconds": outer, "waiting_seconds": waiting,
            "round_share": (outer - waiting) / fit, "bytes_sent": result.get("islands", {}).get("bytes_sent")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders")
    parser.add_argument("--out", default="results/round_share.json")
    args = parser.parse_args()
    rows = [share(Path(run), i) for run in args.runs for i in range(len(list(Path(run).glob("island*/result.json"))))]
    print("| run | island | val loss | fit (s) | outer step (s) | waiting (s) | round's share |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['run']} | {r['island']} | {r['val_loss']:.4f} | {r['fit_seconds']:.1f} | "
              f"{r['outer_seconds']:.2f} | {r['waiting_seconds']:.2f} | {100 * r['round_share']:.2f}% |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
