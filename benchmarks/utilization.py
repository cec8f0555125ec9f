"""Utilization over a shaped link: synchronous rounds, fragments, fragments + overlap.

Runs the same training (the provided MoE, two islands of one process each, ``islands=two_equal``;
``--devices N``: N processes each)
over the same shaped link between two network namespaces (``islands.link=RATE``, see README "A
shaped link on one machine"; needs root and ``ip``/``tc``) three ways:

- ``sync``: one round every H steps, the islands wait for it;
- ``fragments``: ``islands.fragments=F``, one fragment every H / F steps (the same bytes per H steps);
- ``fragments+overlap``: the same with ``islands.overlap_steps=tau``: each round flies while tau
  more inner steps run;
- ``sliced`` (asked for with ``--configs``): ``sync`` with ``islands.exchange=sliced``, every rank
  moving its own slice; with ``--devices N`` every island (and ``none``) runs N processes of batch
  16 / N, so that the planner's ``--path sliced`` can be checked against a measured run;
- ``fragments+overlap+sliced`` (asked for with ``--configs``): ``fragments+overlap`` with
  ``islands.exchange=sliced`` (every rank's slices fly in a thread of its own);

and once with no cross-island exchange at all (``none``: each island trains as a lone island, both
at once, so they share the cores as the others do). ``utilization`` = wall time of ``none`` / wall
time of the config for the same steps (the slower island's fit, both ways); ``loop`` is the same
ratio over the training loop alone (first batch start to last batch end: without meeting the other
islands, opening the lanes, the start agreement and the last, synchronous round), which is what a
run of many rounds converges to.

The link rate: ``--rate auto`` (default) sizes it from the ``none`` run's step time so that one
synchronous exchange of the whole model takes about a third of a round's compute (the ratio of a
1T-parameter model in int4 at 25 Gbit/s and H=100), which puts ``sync`` at or below ~0.8. ``--rtt
100ms`` adds a round-trip time between the islands (netem, else the link's TUN delay line).

    python benchmarks/utilization.py [--quick] --out DIR

writes ``DIR/utilization.json`` (rows: ``config``, ``utilization``, ``loop_utilization``, ``link_rate_bps``, ``rtt_ms``,
``bytes``, ``peak_bps``, ``mean_bps``, ``val_loss``, ...) and ``DIR/utilization.md``. ``peak_bps`` is
the highest rate any round moved its bytes at (bytes / seconds exchanging; on a shaped link about
the link rate while a round's bytes are on it), ``mean_bps`` the bytes over the wall time: the
bandwidth the run needs on average. ``predicted`` is the planner's (``lightning-islands plan``)
prediction for the same settings and the ``none`` run's step time, put on the same footing: the
``none`` run's wall time plus the overhead the planner predicts (``planned_utilization`` in the JSON
is the planner's own compute / wall).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from lightning_islands.app.netns import parse_link
from lightning_islands.codecs import make_codec

CONFIGS = ("none", "sync", "sliced", "fragments", "fragments+overlap", "fragments+overlap+sliced")


def _overrides(args: argparse.Namespace, config: str, rate: str | None) -> list[str]:
    common = ["model=moe_cpu", "islands=two_equal", "logger=csv", "trainer.checkpoint_every_n_steps=0",
              "trainer.checkpoint_every_n_rounds=0",
              f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.steps}",
              "data.val_windows=16", "data.val_batch_size=16", f"islands.sync_every={args.H}",
              f"islands.codec={args.codec}", f"islands.lanes={args.lanes}", f"seed={args.seed}",
              "experiment.name=utilization", "summary_json=true", *args.extra]
    n, batch = args.devices, 16 // args.devices  # the same tokens per step whatever the processes
    member = f"{{devices:{n},batch_size:{batch}}}"
    if config == "none":
        return [*common, f"islands.members=[{member}]"]
    link = [f"islands.link='{rate}'"] if rate else []
    if n != 1:
        link.append(f"islands.members=[{member},{member}]")
    if config == "sync":
        return [*common, *link]
    if config == "sliced":
        return [*common, *link, "islands.exchange=sliced"]
    streaming = [f"islands.fragments={args.fragments}"]
    if "overlap" in config:
        streaming += [f"islands.overlap_steps={args.tau}", f"islands.overlap_alpha={args.alpha}"]
    if config.endswith("sliced"):
        streaming.append("islands.exchange=sliced")
    return [*common, *link, *streaming]


def _train(overrides: list[str], workdir: Path, log: Path) -> Path:
    """One run of the Hydra app; its run folder."""
    cmd = [sys.executable, "-m", "lightning_islands.app.train", *overrides]
    # one thread per process everywhere (two lone islands at once would each take every core otherwise)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=workdir, stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
    text = log.read_text()
    if proc.returncode != 0 or "run folder " not in text:
        raise RuntimeError(f"run failed (exit {proc.returncode}); see {log}:\n{text[-3000:]}")
    return Path(text.split("run folder ", 1)[1].split()[0])


def _rounds(run_dir: Path, island: int) -> list[dict[str, float]]:
    path = run_dir / "logs" / f"island{island}" / "metrics.csv"
    if not path.exists():
        return []
    with path.open() as f:
        return [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f) if r.get("islands/round")]


def _step_seconds(result: dict, steps: int) -> float:
    """An island's median seconds per step (its fit over its steps when too short to have one)."""
    return result.get("step_seconds_median") or result["fit_seconds"] / steps


def _loop_seconds(result: dict) -> float:
    """An island's training loop: first batch start to last batch end (its fit when not recorded)."""
    return result.get("loop_seconds") or result["fit_seconds"]


def run_config(args: argparse.Namespace, config: str, rate: str | None, out: Path) -> dict:
    """One row: the config's wall time, bytes, rates and loss."""
    work = out / config.replace("+", "_")
    work.mkdir(parents=True, exist_ok=True)
    overrides = _overrides(args, config, rate)
    if config == "none":  # two lone islands at once: the same cores shared, nothing crosses
        runs: list[Path] = []
        errors: list[BaseException] = []

        def one(k: int) -> None:
            try:
                runs.append(_train(overrides, work / f"lone{k}", work / f"lone{k}.log"))
            except BaseException as err:  # noqa: BLE001 - re-raised below
                errors.append(err)

        for k in range(2):
            (work / f"lone{k}").mkdir(exist_ok=True)
        threads = [threading.Thread(target=one, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        results = [json.loads((r / "island0" / "result.json").read_text()) for r in runs]
        return {"config": config, "wall_seconds": max(r["fit_seconds"] for r in results),
                "loop_seconds": max(_loop_seconds(r) for r in results),
                "step_seconds": max(_step_seconds(r, args.steps) for r in results),
                "val_loss": sum(r["val_loss"] for r in results) / len(results), "bytes": 0.0, "rounds": 0,
                "peak_bps": 0.0, "mean_bps": 0.0, "seconds_waiting": 0.0,
                "parameters": int(results[0]["parameters"]["total"])}
    run_dir = _train(overrides, work, work / "run.log")
    summary = json.loads((run_dir / "summary.json").read_text())
    islands = summary["islands"]
    wall = max(r["fit_seconds"] for r in islands)
    rates = [(m.get("islands/bytes_sent", 0.0) + m.get("islands/bytes_received", 0.0))
             / m["islands/seconds_exchanging"] * 8
             for i in range(len(islands)) for m in _rounds(run_dir, i) if m.get("islands/seconds_exchanging")]
    total = summary["bytes_exchanged"]
    return {"config": config, "wall_seconds": wall, "loop_seconds": max(_loop_seconds(r) for r in islands),
            "step_seconds": max(_step_seconds(r, args.steps) for r in islands),
            "val_loss": summary["val_loss"], "bytes": total, "rounds": summary["rounds"],
            "peak_bps": max(rates, default=0.0) / 2,  # per direction: each round's bytes went both ways
            "mean_bps": total * 8 / wall / len(islands),  # per island's uplink
            "seconds_waiting": max(r["islands"].get("seconds_waiting", 0.0) for r in islands)}


def predict(args: argparse.Namespace, row: dict, none: dict, rate_bps: float, rtt_ms: float) -> dict:
    """The planner's prediction for a row (``lightning_islands.plan.prediction_for``) with the
    ``none`` run's step time: its utilization per island (compute / wall) and, to set beside the
    measured ratios, the same overhead added to the ``none`` run's wall time and to its training
    loop (the planner models rounds, not a run's one-time start and end)."""
    from lightning_islands.plan.config import prediction_for

    islands = {"members": [{"devices": args.devices}] * 2, "sync_every": args.H, "codec": args.codec,
               "lanes": args.lanes, "fragments": row["fragments"], "overlap_steps": row["overlap_steps"],
               "exchange": "sliced" if row["config"].endswith("sliced") else "leader"}
    pred = prediction_for(islands, numel=none["parameters"], step_seconds=none["step_seconds"], link_bps=rate_bps,
                          rtt_s=rtt_ms / 1e3, rounds=row["rounds"])
    planned = min(pred.utilization)
    compute = args.steps * none["step_seconds"]
    overhead = compute * (1 / planned - 1)
    return {"planned_utilization": planned,
            "predicted_utilization": none["wall_seconds"] / (none["wall_seconds"] + overhead),
            "predicted_loop_utilization": none["loop_seconds"] / (none["loop_seconds"] + overhead)}


def auto_rate(args: argparse.Namespace, none: dict) -> str:
    """The rate at which one synchronous exchange of the model takes a third of a round's compute."""
    payload = make_codec(args.codec).nbytes(none["parameters"])
    seconds = args.H * none["step_seconds"] / 3
    return f"{max(1, int(payload * 8 / seconds / 1e6))}mbit"


def _link(args: argparse.Namespace, rate: str, parser: argparse.ArgumentParser) -> str:
    """``islands.link`` for a rate: with ``--rtt`` and ``--tcp tuned`` appended."""
    if args.rtt:
        if "," in rate:
            parser.error(f"--rtt {args.rtt} and a --rate with an RTT ({rate}): give the RTT once")
        rate = f"{rate},{args.rtt}"
    if args.tcp == "tuned":
        rate = f"{rate},tuned"
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/utilization")
    parser.add_argument("--quick", action="store_true", help="fewer steps (under 10 minutes on 2 cores)")
    parser.add_argument("--steps", type=int, default=None, help="inner steps per run (default 192; quick 96)")
    parser.add_argument("--H", type=int, default=24)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--tau", type=int, default=3, help="overlap_steps of fragments+overlap")
    parser.add_argument("--alpha", type=float, default=0.0, help="overlap_alpha of fragments+overlap")
    parser.add_argument("--codec", default="fp32")
    parser.add_argument("--lanes", type=int, default=2)
    parser.add_argument("--rate", default="auto",
                        help="link rate in bits per second (e.g. 40mbit) or auto; "
                             "',RTT' appends a delay (e.g. 40mbit,100ms)")
    parser.add_argument("--rtt", default=None,
                        help="a round-trip time between the islands for --rate auto (e.g. 100ms; netem, else the "
                             "link's delay line)")
    parser.add_argument("--tcp", choices=["default", "tuned"], default="default",
                        help="the islands' host TCP: a new namespace's, or tuned for a long-fat link (32 MiB "
                             "buffers, no slow start after idle; `--link RATE,RTT,tuned`)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--configs", default="sync,fragments,fragments+overlap",
                        help="which of sync,sliced,fragments,fragments+overlap,fragments+overlap+sliced to run "
                             "(none always runs; sliced: with islands.exchange=sliced, for --devices 2 or more)")
    parser.add_argument("--devices", type=int, default=1, choices=[1, 2, 4, 8, 16],
                        help="processes per island (each with batch 16 / devices)")
    parser.add_argument("--extra", action="append", default=[], help="a Hydra override for every run (repeatable)")
    parser.add_argument("--at-once", action="store_true",
                        help="run every config at the same time as none (needs a --rate other than auto): a smoke "
                             "test of the script, whose timings then say nothing")
    args = parser.parse_args()
    if args.at_once and args.rate == "auto":
        parser.error("--at-once needs a --rate: auto sizes it from the none run")
    args.steps = args.steps or (96 if args.quick else 192)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    configs = [c for c in CONFIGS[1:] if c in args.configs.split(",")]
    done: dict[str, dict] = {}
    if args.at_once:  # the others beside none, each in a thread of its own
        errors: list[BaseException] = []

        def one(config: str) -> None:
            try:
                done[config] = run_config(args, config, _link(args, args.rate, parser), out)
            except BaseException as err:  # noqa: BLE001 - re-raised below
                errors.append(err)

        threads = [threading.Thread(target=one, args=(c,)) for c in configs]
        for t in threads:
            t.start()
        try:
            none = run_config(args, "none", None, out)
        finally:
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
    else:
        none = run_config(args, "none", None, out)
    rate = _link(args, auto_rate(args, none) if args.rate == "auto" else args.rate, parser)
    spec = parse_link(rate)
    rtt_ms = spec.rtt_s * 1e3
    print(f"none: {none['wall_seconds']:.1f} s, {none['step_seconds'] * 1e3:.0f} ms/step; link {rate}", flush=True)
    rows = [none]
    for config in configs:
        row = done.get(config) or run_config(args, config, rate, out)
        rows.append(row)
        print(f"{config}: {row['wall_seconds']:.1f} s", flush=True)
    for row in rows:
        row.update({"utilization": none["wall_seconds"] / row["wall_seconds"],
                    "loop_utilization": none["loop_seconds"] / row["loop_seconds"],
                    "link_rate_bps": spec.rate_bps, "rtt_ms": rtt_ms, "tcp": spec.tcp, "steps": args.steps,
                    "H": args.H, "codec": args.codec,
                    "fragments": args.fragments if "fragments" in row["config"] else 1,
                    "overlap_steps": args.tau if "overlap" in row["config"] else 0})
    for row in rows[1:]:
        row.update(predict(args, row, none, spec.rate_bps, rtt_ms))
    table = ["| config | utilization | loop | predicted | wall (s) | rounds | bytes | peak (Mbit/s) | mean (Mbit/s) "
             "| waiting (s) | val loss |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    table += [f"| {r['config']} | {r['utilization']:.3f} | {r['loop_utilization']:.3f} | "
              f"{r.get('predicted_utilization', 1.0):.3f} | {r['wall_seconds']:.1f} | {r['rounds']} | "
              f"{r['bytes'] / 1e6:.1f} MB | {r['peak_bps'] / 1e6:.1f} | "
              f"{r['mean_bps'] / 1e6:.2f} | {r['seconds_waiting']:.1f} | {r['val_loss']:.4f} |" for r in rows]
    head = (f"link {rate} (shaped with tc between network namespaces), H={args.H}, codec {args.codec}, "
            f"F={args.fragments}, tau={args.tau}, {args.steps} steps, two islands of {args.devices} process(es) x "
            f"batch {16 // args.devices}; "
            f"{time.time() - started:.0f} s in all")
    print(head)
    print("\n".join(table))
    (out / "utilization.json").write_text(json.dumps(rows, indent=1))
    (out / "utilization.md").write_text(head + "\n\n" + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
