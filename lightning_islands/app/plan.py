"""``lightning-islands plan``: predict utilization for the composed config on given hardware and link.

It composes the same Hydra config as ``lightning-islands train`` (any override, e.g.
``islands.sync_every=100 islands.codec=int2``), takes the hardware figures from options, runs the
planner (:mod:`lightning_islands.plan`) and prints a table, or JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_islands.app import rates
from lightning_islands.plan.config import inputs_from_islands, per_island
from lightning_islands.plan.hardware import DEFAULT_MFU, accelerator, step_seconds
from lightning_islands.plan.inputs import LinkSpec, PlanInputs, with_link
from lightning_islands.plan.result import PlanResult
from lightning_islands.plan.search import LinkNeed, min_link_bps
from lightning_islands.plan.simulate import simulate


class PlanError(ValueError):
    """A problem with what ``lightning-islands plan`` was given, with its fix."""


def parse_rate(text: str) -> float:
    """Bits per second from ``25gbit``, ``25G``, ``25e9``, ``200M`` or ``inf``: the syntax of
    ``run --link`` (:func:`lightning_islands.app.rates.parse_rate`); ``25gbps`` and other byte-ish
    units are refused with a :class:`PlanError` that gives the bit form."""
    try:
        return rates.parse_rate(text, allow_inf=True)
    except ValueError as err:
        raise PlanError(str(err)) from None


def _rate_argument(text: str) -> float:
    try:
        return parse_rate(text)
    except PlanError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _numbers(text: str | None, name: str) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PlanError(f"{name}: {text!r} is not a comma-separated list of numbers (e.g. 0.5,0.8)") from None


def build_parser() -> argparse.ArgumentParser:
    """The options of ``lightning-islands plan`` (Hydra overrides are the positional arguments)."""
    p = argparse.ArgumentParser(
        prog="lightning-islands plan",
        description="Predict utilization, idle time and link load of the composed config's islands.* settings "
                    "on given hardware and link. Positional arguments are Hydra overrides, as for train.")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. islands.sync_every=100 islands.codec=int2")
    g = p.add_argument_group("step time (one of)")
    g.add_argument("--step-seconds", help="seconds per inner step, one for all islands or one per island (0.5,0.8)")
    g.add_argument("--flops", help="achieved FLOP/s per device, one or one per island (else --hardware x --mfu)")
    g.add_argument("--mfu", type=float, default=DEFAULT_MFU, help=f"model FLOP utilization with --hardware "
                   f"(default {DEFAULT_MFU})")
    g.add_argument("--tokens-per-step", help="tokens per inner step of each island (default: batch x seq_len x "
                   "devices from the config)")
    m = p.add_argument_group("model")
    m.add_argument("--params", type=float, help="parameters exchanged (all of them; default: counted from the "
                   "config's model)")
    m.add_argument("--active-params", type=float, help="parameters a token uses (MoE; default: --params, or "
                   "counted)")
    h = p.add_argument_group("hardware")
    h.add_argument("--hardware", help="accelerator per island or one for all: h100, h200, b200, gb200, cpu "
                   "(default: cpu for trainer.accelerator=cpu, else h100)")
    h.add_argument("--intra-gbps", help="GB/s the leader receives inside its island (default: the hardware's)")
    h.add_argument("--leader-gbps", help="GB/s of one codec pass on the leader (default: the hardware's)")
    h.add_argument("--path", choices=["leader", "sliced"], default=None,
                   help="leader: every round through rank 0; sliced: each rank exchanges its own slice "
                        "(default: the composed config's islands.exchange)")
    k = p.add_argument_group("link")
    k.add_argument("--link-bps", required=True, type=_rate_argument, help="bits per second per island egress, "
                   "as run --link reads it (25gbit, 25G, 25e9, 200mbit, inf; byte units such as 25gbps are refused)")
    k.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip time between islands (default 0)")
    k.add_argument("--tcp-window-mib", type=float, help="bytes in flight per TCP stream, in MiB (default: half "
                   "the smaller of this machine's tcp_rmem and tcp_wmem maxima)")
    o = p.add_argument_group("output")
    o.add_argument("--target", type=float, default=0.97, help="utilization target for the smallest link "
                   "(default 0.97)")
    o.add_argument("--rounds", type=int, help="simulate a whole run of this many rounds (default: steady state)")
    o.add_argument("--json", action="store_true", help="print JSON instead of a table")
    o.add_argument("--plot", metavar="FILE.png", help="also draw each island's utilization against link bandwidth "
                   "(1/100 to 100x the given link, the target and the smallest link for it marked)")
    return p


def compose_config(overrides: Sequence[str]) -> Any:
    """The training config composed with ``overrides``, as ``lightning-islands train`` composes it."""
    from hydra import compose, initialize_config_dir, initialize_config_module

    from lightning_islands.app.train import config_dir

    where = config_dir()
    context = (initialize_config_module(config_module="lightning_islands.conf", version_base="1.3")
               if where.startswith("pkg://") else initialize_config_dir(config_dir=where, version_base="1.3"))
    try:
        with context:
            return compose(config_name="config", overrides=list(overrides))
    except Exception as err:  # noqa: BLE001 - Hydra raises many kinds; all mean the overrides
        raise PlanError(f"could not compose the config with {list(overrides)}: {err} (keys the config does not "
                        "have yet take '++', e.g. ++islands.fragments=4)") from None


def model_counts(cfg: Any) -> tuple[int, int, list[int]]:
    """Total and active parameters of the config's model, and each transformer block's parameters
    (built on the meta device: no memory, no weights)."""
    import torch
    from hydra.utils import instantiate

    try:
        with torch.device("meta"):
            module = instantiate(cfg.model)
    except Exception as err:  # noqa: BLE001 - any model may fail to build; the fix is the same
        raise PlanError(f"could not build the config's model to count its parameters ({err}): give --params") from None
    counts = module.num_parameters() if hasattr(module, "num_parameters") else {}
    total = int(counts.get("total", sum(p.numel() for p in module.parameters())))
    active = int(counts.get("active", total))
    blocks = getattr(getattr(module, "model", module), "blocks", None)
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks] if blocks is not None else []
    return total, active, sizes


def _tokens_per_step(cfg: Any, devices: list[int]) -> list[float]:
    seq_len = int(cfg.model.get("seq_len", 0) or 0)
    default_batch = int(cfg.data.get("batch_size", 0) or 0)
    out = []
    for member, d in zip(cfg.islands.members, devices):
        batch = int(member.get("batch_size", default_batch) or default_batch)
        data_parallel = d // int(member.get("tensor_parallel_size", 1) or 1)  # tensor-parallel ranks share a batch
        out.append(float(batch * seq_len * data_parallel))
    if not all(out):
        raise PlanError("cannot derive tokens per step from the config: give --tokens-per-step")
    return out


def build_inputs(args: argparse.Namespace, cfg: Any) -> PlanInputs:
    """The plan's inputs from the parsed options and the composed config."""
    members = list(cfg.islands.members)
    n = len(members)
    devices = [int(m.get("devices", 1)) for m in members]
    default_hw = "cpu" if str(cfg.trainer.get("accelerator", "cpu")) == "cpu" else "h100"
    hardware = [accelerator(h) for h in per_island_names(args.hardware or default_hw, n)]
    total = active = None
    blocks: list[int] = []
    if args.params is None:
        total, active, blocks = model_counts(cfg)
    else:
        total = int(args.params)
    active = int(args.active_params) if args.active_params is not None else (active or total)
    steps = _numbers(args.step_seconds, "--step-seconds")
    if steps is None:
        flops = _numbers(args.flops, "--flops")
        if flops is None:
            if any(hw.bf16_flops is None for hw in hardware):
                raise PlanError("give --step-seconds (one per island, e.g. 0.5,0.8), or --flops (achieved FLOP/s "
                                "per device) or a GPU --hardware, for the step time")
            flops = [hw.bf16_flops * args.mfu for hw in hardware]  # type: ignore[operator]
        tokens = _numbers(args.tokens_per_step, "--tokens-per-step") or _tokens_per_step(cfg, devices)
        per_device = per_island(flops, n, "--flops")
        steps = [step_seconds(active, t, f * d)
                 for t, f, d in zip(per_island(tokens, n, "--tokens-per-step"), per_device, devices)]
    intra = _numbers(args.intra_gbps, "--intra-gbps")
    leader = _numbers(args.leader_gbps, "--leader-gbps")
    link = LinkSpec(bps=args.link_bps, rtt_s=args.rtt_ms / 1e3,
                    tcp_window_bytes=None if args.tcp_window_mib is None else args.tcp_window_mib * 2**20)
    return inputs_from_islands(
        cfg.islands, numel=total, step_seconds=per_island(steps, n, "--step-seconds"), link=link,
        intra_bytes_per_s=[v * 1e9 for v in intra] if intra else [hw.intra_bytes_per_s for hw in hardware],
        leader_bytes_per_s=[v * 1e9 for v in leader] if leader else [hw.leader_bytes_per_s for hw in hardware],
        rounds=args.rounds, block_sizes=blocks or None, exchange_path=args.path)


def per_island_names(text: str, n: int) -> list[str]:
    """A comma-separated list of names, one for all islands or one per island."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if len(names) == 1:
        return names * n
    if len(names) != n:
        raise PlanError(f"--hardware: {len(names)} names for {n} islands; give one for all or one per island")
    return names


def _bits(value: float | None) -> str:
    if value is None or math.isinf(value):
        return "unlimited" if value is not None else "none reaches it"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.3g} bit/s"


def _bytes(value: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def summary(inputs: PlanInputs, result: PlanResult, need: LinkNeed) -> dict[str, Any]:
    """Everything ``--json`` prints: the prediction, the smallest link for the target and the inputs."""
    out = result.to_dict()
    out.update({
        "min_link_bps_for_target": need.bps,
        "target": need.target,
        "min_link_note": need.note,
        "inputs": {
            "numel": inputs.numel, "sync_every": inputs.sync_every, "fragments": inputs.fragments,
            "overlap_steps": inputs.overlap_steps, "codec": inputs.codec, "lanes": inputs.lanes,
            "balance": inputs.balance, "exchange_chunk_mib": inputs.exchange_chunk_mib,
            "error_feedback": inputs.use_error_feedback, "exchange_path": inputs.exchange_path,
            "topology": inputs.topology, "max_staleness": inputs.max_staleness, "grace_s": inputs.grace_s,
            "staleness_wait_s": inputs.staleness_wait_s, "min_islands": inputs.min_islands,
            "step_seconds": [s.step_seconds for s in inputs.islands],
            "intra_bytes_per_s": [s.intra_bytes_per_s for s in inputs.islands],
            "leader_bytes_per_s": [s.leader_bytes_per_s for s in inputs.islands],
            "link_bps": None if math.isinf(inputs.link.bps) else inputs.link.bps,
            "rtt_s": inputs.link.rtt_s, "tcp_window_bytes": inputs.link.window,
        },
    })
    return out


def _slow_wait(inputs: PlanInputs) -> str:
    """The wait for a slow island the plan assumed, in words."""
    if inputs.staleness_wait_s is not None:
        return f"{inputs.staleness_wait_s:g} s"
    return "a round, >= 10 s" if inputs.grace_s is None else f"{inputs.grace_s:g} s"


def format_plan(inputs: PlanInputs, result: PlanResult, need: LinkNeed) -> str:
    """The table ``lightning-islands plan`` prints."""
    link = inputs.link
    lines = [
        f"plan: {inputs.num_islands} islands, {inputs.numel:,} parameters, H={inputs.sync_every}, "
        f"fragments {inputs.fragments}, overlap {inputs.overlap_steps} steps, codec {inputs.codec}, "
        f"lanes {inputs.lanes}, balance {inputs.balance}, path {inputs.exchange_path}, topology {inputs.topology}"
        + (f", max_staleness {inputs.max_staleness} (waiting {_slow_wait(inputs)} for a slow island)"
           if inputs.max_staleness else ""),
        f"link {_bits(link.bps)}, RTT {link.rtt_s * 1e3:g} ms, TCP window {link.window / 2**20:.3g} MiB per stream "
        f"-> {_bits(result.link_rate_bps)} while sending",
        "",
        "island  devices  step s  steps/round  utilization  round s  compute s  own work s  waiting s  leader s"
        + ("  late" if inputs.max_staleness else ""),
    ]
    for i, (spec, row) in enumerate(zip(inputs.islands, result.islands)):
        lines.append(f"{i:>6}  {spec.devices:>7}  {spec.step_seconds:>6.3g}  {row.steps_per_round:>11.1f}  "
                     f"{row.utilization:>11.4f}  {row.round_s:>7.4g}  {row.compute_s:>9.4g}  {row.local_s:>10.4g}  "
                     f"{row.waiting_s:>9.4g}  {row.leader_s:>8.4g}"
                     + (f"  {row.late_fraction:>4.0%}" if inputs.max_staleness else ""))
    dropped = [i for i, row in enumerate(result.islands) if row.longest_absence > inputs.max_staleness]
    if inputs.max_staleness and dropped:
        lines.append(f"islands {dropped} miss more than max_staleness={inputs.max_staleness} rounds in a row "
                     f"(up to {max(result.islands[i].longest_absence for i in dropped)}): their work is dropped then; "
                     "raise islands.max_staleness or islands.staleness_wait_s, or use islands.balance=time")
    lines += [
        "",
        f"utilization: min {result.min_utilization:.4f}, all devices {result.utilization_overall:.4f} "
        f"({'steady state' if result.steady else f'a run of {result.rounds} rounds'})",
        f"per round: each island sends {_bytes(result.bytes_per_round)}, {result.link_s:.4g} s on the wire; round "
        f"trips {result.latency_s:.4g} s (header, each chunk's size and payload all-gathers); "
        + (f"the leader gathers {_bytes(result.leader_bytes)} of fp32 at once" if result.leader_bytes
           else "each rank exchanges its own slice"),
        f"link: mean {_bits(result.mean_bps)}, peak demand {_bits(result.peak_bps)}, busy "
        f"{result.link_busy_fraction:.1%} of the time",
        f"smallest link for utilization >= {need.target:g}: {_bits(need.bps)}"
        + ("" if need.note == "bisection" else f" ({need.note})"),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """``lightning-islands plan``; returns the exit code (2 with a message on bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_intermixed_args(list(argv))
    except SystemExit as stop:  # argparse has printed the problem (or the help)
        return int(stop.code or 0)
    try:
        if args.plot and not Path(args.plot).resolve().parent.is_dir():
            raise PlanError(f"--plot {args.plot}: the folder {Path(args.plot).resolve().parent} does not exist; "
                            "create it or write the plot elsewhere")
        cfg = compose_config(args.overrides)
        inputs = build_inputs(args, cfg)
        result = simulate(inputs)
        need = min_link_bps(inputs, args.target)
    except ValueError as err:
        print(f"lightning-islands plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary(inputs, result, need), indent=2))
    else:
        print(format_plan(inputs, result, need))
    if args.plot:
        plot_utilization(inputs, need, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def utilization_curve(inputs: PlanInputs, points: int = 25) -> list[tuple[float, list[float]]]:
    """``(link bits per second, each island's utilization)`` from 1/100 to 100x the plan's link (from
    1 Mbit/s to 1 Tbit/s when it is unlimited), evenly on a log scale."""
    center = inputs.link.bps if math.isfinite(inputs.link.bps) else 1e9
    low, high = (center / 100, center * 100) if math.isfinite(inputs.link.bps) else (1e6, 1e12)
    rates = [low * (high / low) ** (k / (points - 1)) for k in range(points)]
    return [(bps, list(simulate(with_link(inputs, bps)).utilization)) for bps in rates]


def plot_utilization(inputs: PlanInputs, need: LinkNeed, path: str) -> None:
    """Each island's predicted utilization against link bandwidth, written to ``path`` (PNG)."""
    from lightning_islands.app.report import headless_pyplot

    curve = utilization_curve(inputs)
    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for i in range(inputs.num_islands):
        ax.plot([bps / 1e9 for bps, _ in curve], [u[i] for _, u in curve], marker="o", markersize=3,
                label=f"island {i} ({inputs.islands[i].devices} devices)")
    ax.axhline(need.target, linestyle=":", color="grey", label=f"target {need.target:g}")
    if need.bps is not None and math.isfinite(need.bps):
        ax.axvline(need.bps / 1e9, linestyle="--", color="grey", label=f"smallest link for it: {_bits(need.bps)}")
    if math.isfinite(inputs.link.bps):
        ax.axvline(inputs.link.bps / 1e9, color="black", linewidth=1, label=f"given link: {_bits(inputs.link.bps)}")
    ax.set(xscale="log", xlabel="link bandwidth (Gbit/s, log scale)", ylabel="predicted utilization (compute / wall)",
           ylim=(0, 1.02), title=f"H={inputs.sync_every}, F={inputs.fragments}, tau={inputs.overlap_steps}, "
                                 f"{inputs.codec}, RTT {inputs.link.rtt_s * 1e3:g} ms")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
