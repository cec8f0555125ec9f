"""The frontier tables of docs/PLANNING.md: ``python -m lightning_islands.plan.frontier`` prints them.

Two islands, an NVL72 rack of GB200s and an NVL8 box of B200s, 25 Gbit/s and 100 ms apart; a 1T
MoE (50B active) and a 100B dense model; H, codec, fragments and overlap swept. Every figure the
tables assume is a field of :class:`Scenario` or an entry of
:data:`~lightning_islands.plan.hardware.ACCELERATORS`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from lightning_islands.plan.hardware import DEFAULT_MFU, IB_NDR_BYTES_PER_S, accelerator, step_seconds
from lightning_islands.plan.inputs import IslandSpec, LinkSpec, PlanInputs
from lightning_islands.plan.result import PlanResult
from lightning_islands.plan.search import min_link_bps
from lightning_islands.plan.simulate import simulate

H_VALUES = (32, 96, 320)  # multiples of every fragment count below (H % F == 0)
CODECS = ("fp32", "int4", "topk:0.1+int2")
FRAGMENTS = (1, 4, 16)
OVERLAP = 4  # the overlapped variant: tau = min(OVERLAP, H / F) inner steps


@dataclass(frozen=True)
class Scenario:
    """A model on a set of islands over one link (see the module's docstring for the defaults)."""

    name: str
    params: float
    active_params: float
    islands: tuple[tuple[str, int], ...] = (("gb200", 72), ("b200", 8))
    tokens_per_device: int = 16384
    mfu: float = DEFAULT_MFU
    link_bps: float = 25e9
    rtt_s: float = 0.1
    tcp_window_bytes: float = 256 * 2**20
    lanes: int = 2
    balance: str = "time"
    exchange_chunk_mib: float = 1024.0

    def island_specs(self, intra_bytes_per_s: float | None = None) -> tuple[IslandSpec, ...]:
        """Each island's step time (6 x active x tokens / achieved FLOP/s) and its leader's figures."""
        out = []
        for kind, devices in self.islands:
            hw = accelerator(kind)
            assert hw.bf16_flops is not None
            flops = hw.bf16_flops * self.mfu * devices
            seconds = step_seconds(self.active_params, self.tokens_per_device * devices, flops)
            out.append(IslandSpec(devices, seconds, intra_bytes_per_s or hw.intra_bytes_per_s, hw.leader_bytes_per_s))
        return tuple(out)

    def inputs(self, h: int, codec: str, fragments: int, tau: int, **changes: object) -> PlanInputs:
        """The plan of one cell of the table (``changes`` override PlanInputs fields)."""
        link = LinkSpec(bps=self.link_bps, rtt_s=self.rtt_s, tcp_window_bytes=self.tcp_window_bytes)
        base = PlanInputs(self.island_specs(), numel=int(self.params), link=link, sync_every=h, fragments=fragments,
                          overlap_steps=tau, codec=codec, lanes=self.lanes, balance=self.balance,
                          exchange_chunk_mib=self.exchange_chunk_mib)
        return replace(base, **changes) if changes else base


MOE_1T = Scenario("1T MoE (50B active)", 1e12, 50e9)
DENSE_100B = Scenario("100B dense", 100e9, 100e9)


def _gbit(bps: float | None) -> str:
    if bps is None:
        return "never"
    return f"{bps / 1e9:.3g}" if bps >= 1e8 else f"{bps / 1e9:.2g}"


def _over_memory(sc: Scenario, result: PlanResult) -> str:
    """``*`` when the leader gathers more fp32 at once than the smallest device holds."""
    smallest = min(accelerator(kind).memory_bytes for kind, _ in sc.islands)
    return "*" if result.leader_bytes > smallest else ""


def _cell(sc: Scenario, inputs: PlanInputs, target: float) -> tuple[str, str]:
    result = simulate(inputs)
    bold = "**" if result.min_utilization >= target else ""
    need = min_link_bps(inputs, target, rel_tol=0.01).bps
    return f"{bold}{result.min_utilization:.3f}{bold}{_over_memory(sc, result)}", _gbit(need)


def grid(sc: Scenario, target: float = 0.97, h_values: Sequence[int] = H_VALUES,
         codecs: Sequence[str] = CODECS, fragments: Sequence[int] = FRAGMENTS) -> str:
    """The markdown table: per codec, fragments and overlap (none, ``min(4, H/F)`` steps, a whole
    round), the least-used island's utilization at each H (bold: at least ``target``) and the
    smallest link in Gbit/s that reaches ``target``."""
    head = ["codec", "F", "tau"] + [f"H={h}" for h in h_values] + [f"Gbit/s for {target:.0%}, H={h}" for h in h_values]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (2 * len(h_values))]
    for codec in codecs:
        for f in fragments:
            seen = set()
            for rule in (lambda h, f: 0, lambda h, f: min(OVERLAP, h // f), lambda h, f: h // f):
                taus = tuple(rule(h, f) for h in h_values)
                if taus in seen:
                    continue
                seen.add(taus)
                cells = [_cell(sc, sc.inputs(h, codec, f, tau), target) for h, tau in zip(h_values, taus)]
                tau_text = str(taus[0]) if len(set(taus)) == 1 else "/".join(map(str, taus))
                lines.append("| " + " | ".join([f"`{codec}`", str(f), tau_text, *[c[0] for c in cells],
                                                 *[c[1] for c in cells]]) + " |")
    return "\n".join(lines)


def remedies(sc: Scenario, target: float = 0.97, h_values: Sequence[int] = (96, 320),
             codecs: Sequence[str] = ("int4", "topk:0.1+int2"), fragments: int = 16) -> str:
    """What lifts the round's floor at ``fragments`` fragments: larger exchange chunks (fewer round
    trips), every rank exchanging its own slice, a whole round of overlap."""
    variants = [("defaults (1 GiB chunks, leader)", {}, False),
                ("16 GiB chunks", {"exchange_chunk_mib": 16384}, False),
                ("sliced", {"exchange_path": "sliced"}, False),
                ("sliced, 16 GiB chunks", {"exchange_path": "sliced", "exchange_chunk_mib": 16384}, False),
                ("tau = H/F (defaults)", {}, True)]
    head = ["codec", "variant"] + [f"H={h}" for h in h_values] + [f"Gbit/s for {target:.0%}, H={h}" for h in h_values]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (2 * len(h_values))]
    for codec in codecs:
        for label, changes, whole in variants:
            taus = [h // fragments if whole else min(OVERLAP, h // fragments) for h in h_values]
            cells = [_cell(sc, sc.inputs(h, codec, fragments, tau, **changes), target)
                     for h, tau in zip(h_values, taus)]
            row = [f"`{codec}`", label, *[c[0] for c in cells], *[c[1] for c in cells]]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def leader_table(sc: Scenario, h: int = 320, codec: str = "int4") -> str:
    """Where the leader's path limits a round: its seconds per round against the wire's and the round
    trips', and the utilization over the scenario's link and over an unlimited one without latency,
    for a leader fed over NVLink or over one InfiniBand NIC, and for every rank exchanging its slice."""
    lines = ["| F | tau | path | leader s / round (each island) | wire s / round, latency included "
             "| round trips s / round | utilization | utilization, unlimited link, no RTT | leader gathers |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    variants = [("leader, NVLink", None, "leader"), ("leader, IB NIC", IB_NDR_BYTES_PER_S, "leader"),
                ("sliced", None, "sliced")]
    for f in (1, 16):
        for tau in (0, min(OVERLAP, h // f)):
            for label, intra, path in variants:
                inputs = sc.inputs(h, codec, f, tau, islands=sc.island_specs(intra), exchange_path=path)
                result = simulate(inputs)
                free_link = replace(inputs.link, bps=math.inf, rtt_s=0.0, tcp_window_bytes=math.inf)
                free = simulate(replace(inputs, link=free_link))
                leader = " / ".join(f"{row.leader_s:.3g}" for row in result.islands)
                held = f"{result.leader_bytes / 1e9:,.3g} GB" if result.leader_bytes < 1e12 else \
                    f"{result.leader_bytes / 1e9:,.0f} GB"
                held = f"{held}{_over_memory(sc, result)}" if result.leader_bytes else "-"
                lines.append(f"| {f} | {tau} | {label} | {leader} | {result.link_s:.3g} | {result.latency_s:.3g} | "
                             f"{result.min_utilization:.3f} | {free.min_utilization:.3f} | {held} |")
    return "\n".join(lines)


def sanity(params: float = 10e9, h: int = 300, link_bps: float = 41e9, target: float = 0.99) -> str:
    """The step time at which ``params`` dense parameters, two islands of 8 H100s, ``H`` and no
    overlap need exactly ``link_bps`` for ``target`` (no latency): the planner's reading of the
    Streaming DiLoCo / scaling-laws figure (10B, 99%, 41 Gbit/s at H=300)."""
    hw = accelerator("h100")
    rows = ["| codec | bytes per round | step time that needs 41 Gbit/s | that step's tokens at 40% MFU | "
            "planner's link for 99% there |", "|---|---:|---:|---:|---:|"]
    for codec in ("fp32", "bf16"):
        spec = IslandSpec(8, 1.0, hw.intra_bytes_per_s, hw.leader_bytes_per_s)
        inputs = PlanInputs((spec, spec), numel=int(params), link=LinkSpec(bps=math.inf), sync_every=h, codec=codec)
        free = simulate(inputs)
        fixed = h * 1.0 * (1 / free.min_utilization - 1)  # the round's costs besides the wire, at any step time
        bits = 8 * free.bytes_per_round
        seconds = (bits / link_bps + fixed) / (h * (1 / target - 1))
        tokens = seconds * 8 * hw.bf16_flops * DEFAULT_MFU / (6 * params)  # type: ignore[operator]
        check = min_link_bps(replace(inputs, islands=(replace(spec, step_seconds=seconds),) * 2), target).bps
        rows.append(f"| `{codec}` | {free.bytes_per_round / 1e9:.3g} GB | {seconds:.3g} s | {tokens / 1e6:.2g}M | "
                    f"{_gbit(check)} |")
    return "\n".join(rows)


def describe(sc: Scenario) -> str:
    """One line of the scenario's figures."""
    parts = []
    for (kind, devices), spec in zip(sc.islands, sc.island_specs()):
        parts.append(f"{devices} x {accelerator(kind).name}: {spec.step_seconds:.3g} s per step")
    return (f"{sc.name}; {'; '.join(parts)}; {sc.tokens_per_device} tokens per GPU per step, MFU {sc.mfu:g}; "
            f"{sc.link_bps / 1e9:g} Gbit/s, RTT {sc.rtt_s * 1e3:g} ms, {sc.lanes} lanes with "
            f"{sc.tcp_window_bytes / 2**20:g} MiB TCP windows; balance={sc.balance}; exchange chunks of "
            f"{sc.exchange_chunk_mib:g} MiB")


def main() -> None:
    """Print every table of docs/PLANNING.md's frontier section."""
    for sc in (MOE_1T, DENSE_100B):
        print(f"### {sc.name}\n\n{describe(sc)}\n\n{grid(sc)}\n")
    print(f"### What lifts the floor, {MOE_1T.name}, 16 fragments\n\n{remedies(MOE_1T)}\n")
    print(f"### The leader's path, {MOE_1T.name}, int4, H=320\n\n{leader_table(MOE_1T)}\n")
    print(f"### Sanity check: 10B dense, H=300, 99%\n\n{sanity()}\n")


if __name__ == "__main__":
    main()
