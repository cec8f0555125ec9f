"""Idle time of a fast island next to a ~3x slower one, with and without time-balanced rounds.

Runs `islands=slow_island` (two one-process islands, batch 16; island 1 sleeps `--delay` seconds
after every batch) twice: `islands.balance=none` (both run H steps per round, the fast island waits)
and `islands.balance=time` (each runs the steps that fit the slow island's H steps). Reports per
island: inner steps, seconds waiting at outer steps, idle fraction (waiting / fit time), and the
final validation loss of the global model at the same number of rounds.

    python benchmarks/balance.py --rounds 8 --H 10 --delay 0.5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def run(balance: str, args: argparse.Namespace, workdir: Path) -> dict:
    cmd = [sys.executable, "-m", "lightning_islands.app.train", "islands=slow_island", f"islands.balance={balance}",
           f"islands.max_rounds={args.rounds}", f"islands.sync_every={args.H}",
           f"islands.members.1.step_delay_s={args.delay}", "trainer.max_steps=100000",
           "trainer.val_check_interval=100000", "trainer.checkpoint_every_n_steps=0", "experiment.name=balance"]
    out = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, check=True).stdout
    run_dir = Path(out.split("run folder ", 1)[1].split()[0])
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--H", type=int, default=10)
    parser.add_argument("--delay", type=float, default=0.5, help="seconds island 1 sleeps after each batch")
    parser.add_argument("--out", default="results/balance")
    args = parser.parse_args()
    out = Path(args.out) / time.strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for balance in ("none", "time"):
        summary = run(balance, args, out)
        for r in summary["islands"]:
            rows.append({"balance": balance, "island": r["island"], "steps": r["global_step"],
                         "step_ms": 1e3 * (r["step_seconds_median"] or 0.0),
                         "waiting_s": r["islands"]["seconds_waiting"], "fit_s": r["fit_seconds"],
                         "idle_fraction": r["idle_fraction"], "val_loss": r["val_loss"],
                         "tokens": r["tokens"]})
    table = ["| balance | island | inner steps | median step (ms) | waiting (s) | fit (s) | idle fraction | val loss |",
             "|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['balance']} | {r['island']} | {r['steps']} | {r['step_ms']:.0f} | {r['waiting_s']:.1f} | "
              f"{r['fit_s']:.1f} | {r['idle_fraction']:.3f} | {r['val_loss']:.4f} |" for r in rows]
    print("\n".join(table))
    (out / "table.md").write_text("\n".join(table) + "\n")
    (out / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
