"""Islands that die and come back: stall, recovery, goodput and loss, against a run without faults.

Runs the same training (the provided MoE, two islands of one process each, ``islands=two_equal``)
twice, both writing checkpoints every ``--ckpt-every`` steps: once without faults, and once with
``islands.max_restarts`` while this script SIGKILLs
island 1's training process every ``--every`` rounds' worth of time (the time the fault-free run
took for that many rounds), as a lost machine would end. The launcher's torch.distributed.run
restarts the island from its last checkpoint (or from nothing before the first), it rejoins island
0 (which trains on meanwhile), and the run ends when island 0 has taken its steps.

    python benchmarks/faults.py [--quick] --out DIR

writes ``DIR/faults.json`` and ``DIR/faults.md``: per fault, how long until island 1 was back in a
round (fault to recovery; its first round back ends bit-identical to island 0's, which the state
hash of every round checks); per run, the wall time, island 0's longest wait in a round (its stall),
the validation loss and the goodput: inner steps merged into the global model (each round, H times
the islands merged: a joiner's round and a lost island's are not) per second, also relative to the
run without faults.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def _overrides(args: argparse.Namespace, faults: bool) -> list[str]:
    common = ["model=moe_cpu", "islands=two_equal", "logger=csv", f"trainer.checkpoint_every_n_steps={args.ckpt_every}",
              f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.steps}",
              "data.val_windows=16", "data.val_batch_size=16", f"islands.sync_every={args.H}",
              f"islands.codec={args.codec}", f"seed={args.seed}", "experiment.name=faults", "summary_json=true",
              f"islands.grace_s={args.grace}", *args.extra]
    return [*common, f"islands.max_restarts={args.kills + 2}"] if faults else common


def _island_worker(island: int) -> int | None:
    """The pid of island ``island``'s training process (the app's worker under torch.distributed.run)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"lightning_islands.app.worker" in cmdline and b"torch.distributed.run" not in cmdline \
                and f"LI_ISLAND={island}".encode() in environ:
            return int(entry.name)
    return None


class Killer(threading.Thread):
    """SIGKILLs island 1's training process ``kills`` times, each after it has trained ``period`` s."""

    def __init__(self, period: float, kills: int, log: Path) -> None:
        super().__init__(daemon=True)
        self.period, self.kills, self.log = period, kills, log
        self.killed: list[float] = []  # when
        self.back: list[float] = []  # when island 1 said it rejoined
        self.done = threading.Event()

    def run(self) -> None:
        seen_pid, born = None, 0.0
        while not self.done.is_set():
            pid, now = _island_worker(1), time.time()
            self._watch_log()
            if pid is not None and pid != seen_pid:
                seen_pid, born = pid, now
            if pid is not None and len(self.killed) < self.kills and now - born >= self.period:
                os.kill(pid, signal.SIGKILL)
                self.killed.append(now)
                seen_pid = None
            time.sleep(0.05)

    def _watch_log(self) -> None:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return
        while text.count("island 1 rejoins the run at round") > len(self.back):
            self.back.append(time.time())


def _train(overrides: list[str], workdir: Path, log: Path, killer: Killer | None) -> Path:
    cmd = [sys.executable, "-m", "lightning_islands.app.train", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    workdir.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        if killer is not None:
            killer.start()
        proc = subprocess.run(cmd, cwd=workdir, stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
        if killer is not None:
            killer.done.set()
            killer.join()
    text = log.read_text()
    if proc.returncode != 0 or "run folder " not in text:
        raise RuntimeError(f"run failed (exit {proc.returncode}); see {log}:\n{text[-3000:]}")
    return Path(text.split("run folder ", 1)[1].split()[0])


def _rounds(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "logs" / "island0" / "metrics.csv"
    with path.open() as f:
        return [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f) if r.get("islands/round")]


def run(args: argparse.Namespace, faults: bool, out: Path, period: float = 0.0) -> dict:
    work = out / ("faults" if faults else "clean")
    killer = Killer(period, args.kills, work / "run.log") if faults else None
    started = time.time()
    run_dir = _train(_overrides(args, faults), work, work / "run.log", killer)
    wall = time.time() - started
    summary = json.loads((run_dir / "summary.json").read_text())
    rounds = _rounds(run_dir)
    merged_steps = sum((2.0 - m.get("islands/islands_left_out", 0.0)) * args.H for m in rounds)
    island0 = json.loads((run_dir / "island0" / "result.json").read_text())
    row = {"run": "faults" if faults else "clean", "wall_seconds": wall, "fit_seconds": island0["fit_seconds"],
           "rounds": len(rounds), "val_loss": summary["val_loss"], "merged_steps": merged_steps,
           "goodput_steps_per_s": merged_steps / island0["fit_seconds"],
           "max_wait_s": max((m.get("islands/seconds_waiting", 0.0) for m in rounds), default=0.0)}
    if killer is not None:
        text = (work / "run.log").read_text(errors="replace")
        row["kills"] = len(killer.killed)
        row["rejoined"] = text.count("island 1 rejoins the run at round")
        row["recovery_s"] = [b - k for k, b in zip(killer.killed, killer.back)]
        row["state_repaired_rounds"] = text.count("global state differs")
        row["restarts_left_out"] = text.count("members [0, 1] -> [0]")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/faults")
    parser.add_argument("--quick", action="store_true", help="fewer steps and one fault")
    parser.add_argument("--steps", type=int, default=None, help="inner steps of island 0 (default 480; quick 192)")
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--every", type=int, default=20, help="rounds between faults")
    parser.add_argument("--kills", type=int, default=None, help="faults (default: as many as fit)")
    parser.add_argument("--grace", type=float, default=1.0,
                        help="islands.grace_s (below the restart time: the survivor goes on alone, then takes it back)")
    parser.add_argument("--ckpt-every", type=int, default=40,
                        help="trainer.checkpoint_every_n_steps (both runs): a restarted island resumes from its last")
    parser.add_argument("--codec", default="fp32")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--extra", action="append", default=[], help="a Hydra override for every run (repeatable)")
    args = parser.parse_args()
    args.steps = args.steps or (192 if args.quick else 480)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clean = run(args, False, out)
    round_s = clean["fit_seconds"] / max(1, clean["rounds"])
    args.kills = args.kills if args.kills is not None else max(1, clean["rounds"] // args.every - 1)
    print(f"clean: {clean['fit_seconds']:.1f} s, {clean['rounds']} rounds, {round_s:.2f} s/round; "
          f"killing island 1 every {args.every} rounds ({args.every * round_s:.1f} s), {args.kills} times", flush=True)
    faulty = run(args, True, out, period=args.every * round_s)
    faulty["goodput_relative"] = faulty["goodput_steps_per_s"] / clean["goodput_steps_per_s"]
    faulty["loss_relative"] = faulty["val_loss"] / clean["val_loss"] - 1
    rows = [clean, faulty]
    (out / "faults.json").write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2))
    lines = ["| run | fit s | rounds | val loss | merged steps | goodput (steps/s) | max wait s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['run']} | {r['fit_seconds']:.1f} | {r['rounds']} | {r['val_loss']:.4f} | {r['merged_steps']:.0f} "
              f"| {r['goodput_steps_per_s']:.2f} | {r['max_wait_s']:.2f} |" for r in rows]
    lines += ["", f"faults: {faulty['kills']} kills, {faulty['rejoined']} rejoins, recovery (kill to back in a round) "
              f"{', '.join(f'{s:.1f}' for s in faulty['recovery_s'])} s; goodput {faulty['goodput_relative']:.3f} of "
              f"the clean run; loss {faulty['loss_relative'] * 100:+.2f}%; state repaired on rejoin "
              f"{faulty['state_repaired_rounds']} times (then bit-identical)"]
    (out / "faults.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
