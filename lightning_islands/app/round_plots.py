"""Curves and per-round plots of one run, from its own history (``island{i}/history.jsonl``, written by
:class:`~lightning_islands.app.history.History` whatever the logger).

- :func:`val_points`: island 0's validation loss against the tokens all islands trained and against
  wall time;
- :func:`plot_rounds`: per round and island, the bytes sent, where the time went (computing,
  exchanging, waiting) and the islands present over time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Histories = Mapping[int, Sequence[Mapping[str, Any]]]


def _events(records: Sequence[Mapping[str, Any]], kind: str) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("event") == kind]


def _tokens_at(records: Sequence[Mapping[str, Any]], round_index: int) -> float:
    """An island's tokens merged by the end of round ``round_index`` (0 before its first round)."""
    done = [r["tokens"] for r in _events(records, "round") if r["round"] <= round_index]
    return float(done[-1]) if done else 0.0


def val_points(histories: Histories) -> list[tuple[float, float, float]]:
    """``(tokens of all islands, seconds, val loss)`` of island 0's validations: its own tokens then
    plus those the other islands had merged by the same round. Empty without a history."""
    own = histories.get(0)
    if not own:
        return []
    by_step: dict[Any, tuple[float, float, float]] = {}  # the last validation of a step wins (the final one)
    for v in _events(own, "val"):
        others = sum(_tokens_at(h, int(v.get("round", 0))) for i, h in histories.items() if i != 0)
        by_step[v.get("step", len(by_step))] = (float(v["tokens"]) + others, float(v["t"]), float(v["val_loss"]))
    return list(by_step.values())


def round_rows(records: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """One island's rounds: ``round``, ``t``, ``bytes_sent``, and the round's seconds split into
    ``compute`` (the rest), ``exchange`` (the training thread's time on the exchange: all of it, or
    when it flew only the blocking part) and ``wait`` (for the other islands), ``present``."""
    rows, last_t = [], 0.0
    for r in records:
        if r.get("event") == "start":  # a (re)start: the next round's time counts from here
            last_t = float(r.get("t", last_t))
            continue
        if r.get("event") != "round":
            continue
        t = float(r["t"])
        waited = float(r.get("seconds_waiting", 0.0))
        if "seconds_blocking" in r:  # the exchange flew: the training thread's share, its wait included
            exchanged = max(0.0, float(r["seconds_blocking"]) - waited)
        else:
            exchanged = float(r.get("seconds_exchanging", 0.0))
        took = max(0.0, t - last_t)
        rows.append({"round": float(r["round"]), "t": t, "bytes_sent": float(r.get("bytes_sent", 0.0)),
                     "compute": max(0.0, took - exchanged - waited), "exchange": exchanged, "wait": waited,
                     "present": float(r.get("islands_present", 1.0)),
                     "left_out": float(r.get("islands_left_out", 0.0))})
        last_t = t
    return rows


def plot_rounds(histories: Histories, path: str | Path, title: str) -> bool:
    """Three panels for one run: bytes sent per round, each island's round time split into compute,
    exchange and wait, and the islands present over time. False when no island recorded a round."""
    rows = {i: round_rows(h) for i, h in sorted(histories.items())}
    if not any(rows.values()):
        return False
    from lightning_islands.app.report import headless_pyplot

    plt = headless_pyplot()
    fig, (bytes_ax, time_ax, members_ax) = plt.subplots(3, 1, figsize=(9, 10))
    n = max(len(rows), 1)
    width = 0.8 / n
    for k, (island, rs) in enumerate(rows.items()):
        xs = [r["round"] + (k - (n - 1) / 2) * width for r in rs]
        bytes_ax.bar(xs, [r["bytes_sent"] / 1e6 for r in rs], width=width, label=f"island {island}")
        bottom = [0.0] * len(rs)
        for part, hatch in (("compute", ""), ("exchange", "//"), ("wait", "..")):
            values = [r[part] for r in rs]
            time_ax.bar(xs, values, width=width, bottom=bottom, hatch=hatch, color=f"C{k}",
                        alpha={"compute": 0.9, "exchange": 0.6, "wait": 0.3}[part],
                        label=f"island {island} {part}")
            bottom = [b + v for b, v in zip(bottom, values)]
        members_ax.step([0.0] + [r["t"] for r in rs], [rs[0]["present"] if rs else 1] + [r["present"] for r in rs],
                        where="post", label=f"island {island} sees", color=f"C{k}")
    bytes_ax.set(xlabel="round", ylabel="MB sent", title=f"{title}: bytes sent per round")
    time_ax.set(xlabel="round", ylabel="seconds", title="where each island's round went")
    members_ax.set(xlabel="seconds since each island's start", ylabel="islands present", title="membership over time",
                   ylim=(0, max(r["present"] for rs in rows.values() for r in rs) + 0.5))
    members_ax.yaxis.get_major_locator().set_params(integer=True)
    for ax in (bytes_ax, time_ax, members_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
