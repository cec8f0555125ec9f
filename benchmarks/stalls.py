"""Faults without a reset: how long do the survivors stall, and what does a fault cost?

For each fault kind, island count and phase, runs the test regression (``tests/scripts/
islands_regression.py``: 32 steps, H=4, 8 rounds by default) as islands over a shaped link and makes island 1
fall once: in round 2's exchange, or after inner step 6 (in round 1):

- ``KILL``: SIGKILL (its sockets close: the others get a reset); torch.distributed.run restarts it
  (``--max-restarts 1``) and it rejoins.
- ``STOP``: SIGSTOP (alive, silent, its sockets open: no reset, no packets).
- ``LINKDOWN``: its veth is taken down inside its namespace (no reset, no packets).

    python benchmarks/stalls.py --out DIR [--kinds KILL,STOP,LINKDOWN] [--islands 2,3,4]

writes ``DIR/stalls.json`` and ``DIR/stalls.md``: per run, island 0's longest stall between two of
its rounds and its median round, the time from the fault (island 1 writes its pid just before it
falls) to the end of that stall (island 0's first round without it), the attempts island 0 ran
again, and the rounds the survivors lost (of 8) and island 1 missed. Every survivor's global state
is checked bit-identical to island 0's in every round. Needs root (namespaces and ``tc``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "islands_regression.py"
ROUNDS, H = 8, 4
FAULT_AT = {"exchange": 2, "inner": 6}  # round 2's exchange; inner step 6 (in round 1)


def _rounds(out: Path, island: int) -> dict[int, tuple[float, str]]:
    """Round -> (file time, state digest) of what island ``island`` saved."""
    found = {}
    for path in out.glob(f"island{island}_round*.pt"):
        saved = torch.load(path, weights_only=False)
        found[int(saved["round"])] = (path.stat().st_mtime, saved["digest"])
    return found


def one(kind: str, n: int, phase: str, grace: float, link: str, out: Path, rounds_run: int = ROUNDS) -> dict:
    """Run ``n`` islands with island 1 falling by ``kind`` in ``phase``; the row of the table."""
    sizes = ",".join(str(4 + 2 * i) for i in range(n))
    cmd = [sys.executable, "-m", "lightning_islands.app.cli", "run", "--islands", ",".join("1" * n), "--live", "off",
           "--max-restarts", "1" if kind == "KILL" else "0", "--link", link, "--", sys.executable, str(SCRIPT),
           "--out", str(out), "--steps", str(rounds_run * H), "--H", str(H), "--batch-sizes", sizes, "--grace-s",
           str(grace), "--deadline-s", "300", "--fault", f"1:{phase}:{FAULT_AT[phase]}:{kind}"]
    started = time.monotonic()
    log = (out.parent / f"{out.name}.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    survivors = [i for i in range(n) if i != 1]
    while not all((out / f"island{i}_done").exists() for i in survivors) and proc.poll() is None:
        if time.monotonic() - started > 600:
            proc.kill()
            raise RuntimeError(f"{kind} x {n} islands ({phase}): the survivors did not finish in 600 s")
        time.sleep(0.2)
    pid_file = out / "pid_island1"
    fault_at = pid_file.stat().st_mtime if pid_file.exists() else None
    if kind != "KILL" and pid_file.exists():
        os.kill(int(pid_file.read_text()), signal.SIGKILL)  # stopped or cut off: it never ends by itself
    proc.wait(timeout=300)
    log.close()
    text = (out.parent / f"{out.name}.log").read_text()
    rounds = {i: _rounds(out, i) for i in range(n)}
    first = rounds[0]
    for i in survivors:
        for r, (_, digest) in rounds[i].items():
            if digest != first[r][1]:
                raise RuntimeError(f"{kind} x {n} ({phase}): island {i}'s round {r} differs from island 0's")
    times = [first[r][0] for r in sorted(first)]
    gaps = [b - a for a, b in zip(times, times[1:])]
    longest = max(range(len(gaps)), key=gaps.__getitem__)
    return {
        "kind": kind, "islands": n, "phase": phase, "fault_seen": fault_at is not None,
        "stall_s": max(gaps), "median_round_s": statistics.median(gaps),
        "recover_s": (times[longest + 1] - fault_at) if fault_at is not None else None,
        "attempts_again": len(re.findall(r"^\[island 0\] islands: .*\(attempt \d+\)$", text, re.M)),
        "survivor_rounds_lost": rounds_run - min(len(rounds[i]) for i in survivors),
        "island1_rounds_missed": rounds_run - len(rounds[1]),
        "wall_s": time.monotonic() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--kinds", default="KILL,STOP,LINKDOWN")
    parser.add_argument("--islands", default="2,3,4")
    parser.add_argument("--phases", default="inner,exchange")
    parser.add_argument("--grace", type=float, default=3.0, help="islands.grace_s")
    parser.add_argument("--link", default="200mbit", help="the shaped link (--link of the run command)")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"rounds of H={H} per run (default {ROUNDS}; at least {FAULT_AT['exchange'] + 2}: "
                             "a round after the fault's)")
    args = parser.parse_args()
    if args.rounds < FAULT_AT["exchange"] + 2:
        parser.error(f"--rounds {args.rounds}: the fault falls in round {FAULT_AT['exchange']}, give "
                     f"{FAULT_AT['exchange'] + 2} or more")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for kind in args.kinds.split(","):
        for n in (int(v) for v in args.islands.split(",")):
            for phase in args.phases.split(","):
                row = one(kind, n, phase, args.grace, args.link, args.out / f"{kind.lower()}_{n}_{phase}",
                          args.rounds)
                rows.append(row)
                print(json.dumps(row), flush=True)
    (args.out / "stalls.json").write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                                      "rows": rows}, indent=2))
    lines = [f"grace_s={args.grace:g}, link {args.link}, {args.rounds} rounds of H={H}; island 1 falls once",
             "", "| fault | islands | phase | longest stall (s) | median round (s) | fault to recovery (s) "
             "| attempts run again | survivors' rounds lost | island 1's rounds missed |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        recover = f"{r['recover_s']:.1f}" if r["recover_s"] is not None else "-"
        lines.append(f"| {r['kind']} | {r['islands']} | {r['phase']} | {r['stall_s']:.1f} | "
                     f"{r['median_round_s']:.2f} | {recover} | {r['attempts_again']} | {r['survivor_rounds_lost']} | "
                     f"{r['island1_rounds_missed']} |")
    (args.out / "stalls.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
