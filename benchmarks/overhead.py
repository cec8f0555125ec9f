"""Overhead of IslandStrategy against plain FSDP2 when no outer step happens (H very large).

Runs, alternating A B A B ..., the same job twice over: `strategy=fsdp` (2 processes, batch 8) and
`strategy=islands` with one island of the same shape and `islands.sync_every` larger than the run,
and compares the median steady-state step time (batch start to batch start, after 10 warm-up
steps). Both sides run in the same session so machine noise hits both; the ratio is what matters.

    python benchmarks/overhead.py --steps 120 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMON = ["trainer.val_check_interval=100000", "trainer.checkpoint_every_n_steps=0", "data.val_windows=8",
          "data.val_batch_size=8", "logger=csv"]
SIDES = {
    "fsdp": ["strategy=fsdp", "strategy.devices=2", "data.batch_size=8"],
    "islands_H_inf": ["strategy=islands", "islands.members=[{devices:2,batch_size:8}]",
                      "islands.sync_every=100000000"],
}


def run_once(side: str, steps: int, workdir: Path) -> dict:
    cmd = [sys.executable, "-m", "lightning_islands.app.train", *SIDES[side], *COMMON, f"trainer.max_steps={steps}",
           "experiment.name=overhead"]
    out = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, check=True).stdout
    run_dir = Path(out.split("run folder ", 1)[1].split()[0])
    result = json.loads((run_dir / "island0" / "result.json").read_text())
    return {"side": side, "step_seconds": result["step_seconds_median"], "fit_seconds": result["fit_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="results/overhead")
    args = parser.parse_args()
    out = Path(args.out) / time.strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in range(args.repeats):
        for side in SIDES:
            row = run_once(side, args.steps, out)
            row["repeat"] = r
            rows.append(row)
            print(f"repeat {r} {side:>14}: {row['step_seconds'] * 1e3:8.1f} ms/step", flush=True)
    med = {s: statistics.median(r["step_seconds"] for r in rows if r["side"] == s) for s in SIDES}
    ratio = med["islands_H_inf"] / med["fsdp"]
    table = ["| run | median step (ms) |", "|---|---|"]
    table += [f"| {s} | {v * 1e3:.1f} |" for s, v in med.items()]
    table.append(f"| ratio islands/fsdp | {ratio:.3f} |")
    print("\n".join(table))
    (out / "results.json").write_text(json.dumps({"rows": rows, "median": med, "ratio": ratio}, indent=2))
    (out / "table.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
