"""The end-of-run summary: read each island's ``result.json`` and say what happened."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """Collect ``island*/result.json`` under ``run_dir`` into one summary dict."""
    run_dir = Path(run_dir)
    results = [json.loads(p.read_text()) for p in sorted(run_dir.glob("island*/result.json"))]
    if not results:
        raise FileNotFoundError(f"no island*/result.json under {run_dir}; did the islands finish?")
    first = results[0]
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "strategy": first["strategy"],
        "val_loss": first["val_loss"],
        "val_ppl": first["val_ppl"],
        "tokens": sum(r["tokens"] for r in results),
        "wall_seconds": max(r["fit_seconds"] for r in results),
        "islands": results,
    }
    if "parameters" in first:
        summary["parameters"] = first["parameters"]
    link = run_dir / "link.json"  # written by the launcher when the islands ran behind a shaped link
    if link.exists():
        summary["link"] = json.loads(link.read_text()).get("describe")
    if first.get("islands"):
        summary["rounds"] = first.get("rounds")
        summary["bytes_exchanged"] = sum(r["islands"].get("bytes_sent", 0.0) for r in results)
        summary["val_loss_per_island"] = [r["val_loss"] for r in results]
        summary["mesh_per_island"] = [r.get("mesh") for r in results]
        total = (first.get("parameters") or {}).get("total")
        if total:
            summary.update(reference_bytes(int(total), len(results), int(summary["rounds"] or 0),
                                           max(int(r.get("fit_steps", r["global_step"])) for r in results),
                                           int(first.get("fragments", 1))))
    return summary


def reference_bytes(parameters: int, islands: int, rounds: int, steps: int, fragments: int = 1) -> dict[str, float]:
    """What the same run would have sent across the cut between islands (summed over islands):
    ``bytes_fp32``, the same rounds with fp32 pseudo-gradients (each island sends 4 bytes per
    parameter of the round's fragment, about ``1 / fragments`` of them, to each other island), and
    ``bytes_sync_dp``, synchronous data parallelism over the
    same islands (a bandwidth-optimal all-reduce of fp32 gradients every step: ``2 (islands - 1)``
    full copies cross between islands per step, 8 bytes per parameter for two islands)."""
    return {"bytes_fp32": float(rounds * islands * (islands - 1) * 4 * parameters / fragments),
            "bytes_sync_dp": float(steps * 2 * (islands - 1) * 4 * parameters)}


def _times_fewer(reference: float, sent: float) -> str:
    return f"{reference / sent:,.1f}x fewer" if sent > 0 else "none sent"


def format_summary(summary: dict[str, Any]) -> str:
    """A few human lines."""
    lines = ["", "=== lightning-islands summary ===",
             f"strategy            {summary['strategy']}",
             f"final val loss      {summary['val_loss']:.4f}   (perplexity {summary['val_ppl']:.3f})",
             f"tokens trained      {summary['tokens']:,}",
             f"wall time (fit)     {summary['wall_seconds']:.1f} s   "
             f"({summary['tokens'] / max(summary['wall_seconds'], 1e-9):,.0f} tokens/s)"]
    if "parameters" in summary:
        p = summary["parameters"]
        lines.append(f"parameters          {p.get('total', 0):,} total, {p.get('active', 0):,} active")
    for r in summary["islands"]:
        extra = ""
        if r.get("islands"):
            isl = r["islands"]
            extra = (f", sent {isl.get('bytes_sent', 0) / 1e6:.2f} MB,"
                     f" exchanging {isl.get('seconds_exchanging', 0):.2f} s,"
                     f" waiting {isl.get('seconds_waiting', 0):.2f} s")
        mesh = r.get("mesh") or {}
        layout = "".join(f" {k}={v}" for k, v in mesh.items() if k != "dp" and v > 1)
        lines.append(f"island {r['island']}: {r['world_size']} proc{layout} x batch {r['batch_size']}, "
                     f"{r['global_step']} steps, val loss {r['val_loss']:.4f}{extra}")
    if "rounds" in summary:
        sent = summary["bytes_exchanged"]
        lines.append(f"outer rounds        {summary['rounds']}   cross-island bytes {sent / 1e6:.2f} MB")
        if "bytes_sync_dp" in summary:
            lines.append(f"bytes vs fp32       {_times_fewer(summary['bytes_fp32'], sent)} than the same rounds "
                         f"in fp32 ({summary['bytes_fp32'] / 1e6:.2f} MB)")
            lines.append(f"bytes vs sync DP    {_times_fewer(summary['bytes_sync_dp'], sent)} than synchronous data "
                         f"parallelism across the same cut ({summary['bytes_sync_dp'] / 1e6:,.1f} MB)")
    if summary.get("link"):
        lines.append(f"link                {summary['link']}")
    for plot in summary.get("plots", []):
        lines.append(f"plot                {plot}")
    lines.append(f"logs                {summary['run_dir']}  (checkpoints in island*/checkpoints)")
    return "\n".join(lines)
