"""Islands that parallelize differently: step time, the round's bytes and seconds, and loss.

Runs the default job (island 0: 2 processes of FSDP2 with batch 8 each; island 1: 1 process with
batch 16) and the same job with island 0 as 2 processes of tensor parallelism reading one batch of 16
(`experiment=mixed_parallel`) and as 2 processes of expert parallelism with batch 8 each. Every
variant trains 32 windows per step, so the final validation losses compare at equal tokens. Reports
per island: its mesh, median step time, bytes sent per round, the last round's seconds (gather,
exchange, merge and scatter, without the wait for the other island), its fit time and mean step
(fit / steps: under tensor parallelism a step's two processes wait for each other, so its median
understates the mean), and the final validation loss of the global model.

    python benchmarks/parallelism.py [--quick] [--steps 300] [--out results/parallelism]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from round_share import share  # benchmarks/round_share.py, beside this script

VARIANTS = {
    "fsdp": [],
    "tensor parallel": ["experiment=mixed_parallel"],
    "expert parallel": ["islands.members.0.expert_parallel_size=2"],
}


def run(name: str, overrides: list[str], args: argparse.Namespace, workdir: Path) -> dict:
    cmd = [sys.executable, "-m", "lightning_islands.app.train", *overrides, f"trainer.max_steps={args.steps}",
           f"trainer.val_check_interval={args.steps}", "trainer.checkpoint_every_n_steps=0",
           "trainer.checkpoint_every_n_rounds=0",
           f"experiment.name=parallelism_{name.split()[0]}", f"seed={args.seed}", *args.extra]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    run_dir = Path(proc.stdout.split("run folder ", 1)[1].split()[0])
    return json.loads((run_dir / "summary.json").read_text())


def round_seconds(run_dir: Path, island: int) -> float:
    """Mean seconds of a round on ``island`` without its wait for the others (from its CSV log)."""
    row = share(run_dir, island)
    return (row["outer_seconds"] - row["waiting_seconds"]) / max(1, row["rounds"] or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--quick", action="store_true", help="60 steps")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of: " + ", ".join(VARIANTS))
    parser.add_argument("--out", default="results/parallelism")
    parser.add_argument("extra", nargs="*", help="more Hydra overrides for every job")
    args = parser.parse_args()
    if args.quick:
        args.steps = 60
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.variants.split(","):
        started = time.time()
        summary = run(name, VARIANTS[name], args, out.resolve())
        for r in summary["islands"]:
            isl = r["islands"]
            rows.append({"variant": name, "island": r["island"], "mesh": r.get("mesh"), "processes": r["world_size"],
                         "batch": r["batch_size"], "step_ms": 1e3 * (r["step_seconds_median"] or 0.0),
                         "round_bytes": isl["bytes_sent"] / max(1, r["rounds"]),
                         "round_s": round_seconds(Path(r["log_dir"]), r["island"]), "rounds": r["rounds"],
                         "fit_s": r["fit_seconds"], "mean_step_ms": 1e3 * r["fit_seconds"] / max(1, r["global_step"]),
                         "val_loss": r["val_loss"], "tokens": summary["tokens"], "job_s": time.time() - started})
    table = ["| variant | island | mesh (dp, tp, ep) | processes x batch | median step (ms) | mean step (ms) | "
             "fit (s) | bytes sent per round | round, own (s) | val loss |", "|---" * 10 + "|"]
    for r in rows:
        m = r["mesh"] or {}
        table.append(f"| {r['variant']} | {r['island']} | {m.get('dp')}, {m.get('tp')}, {m.get('ep')} | "
                     f"{r['processes']} x {r['batch']} | {r['step_ms']:.0f} | {r['mean_step_ms']:.0f} | "
                     f"{r['fit_s']:.1f} | {r['round_bytes'] / 1e6:.3f} MB | {r['round_s'] or 0.0:.3f} | "
                     f"{r['val_loss']:.4f} |")
    print("\n".join(table))
    (out / "table.md").write_text("\n".join(table) + "\n")
    (out / "parallelism.json").write_text(json.dumps({"steps": args.steps, "seed": args.seed, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
