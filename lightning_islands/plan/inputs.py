"""What the planner is told: the islands, the link between them and the ``islands.*`` settings.

Every class validates itself on construction and raises a ValueError that names the bad value and
the fix, so a plan never starts from numbers the training run would refuse.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from lightning_islands.codecs import Codec, default_error_feedback, make_codec
from lightning_islands.engine.butterfly import Butterfly
from lightning_islands.engine.settings import TOPOLOGIES, IslandSettings

_ENGINE = IslandSettings()  # the engine's defaults: a plan of a config assumes what training does

# Linux's defaults: net.ipv4.tcp_rmem max 6 MiB, tcp_wmem max 4 MiB; about half of a socket buffer
# holds data (the rest is bookkeeping), so a stream keeps about 2 MiB in flight.
FALLBACK_TCP_WINDOW = 2 * 2**20
EXCHANGE_PATHS = ("leader", "sliced")


def default_tcp_window(proc: Path = Path("/proc/sys/net/ipv4")) -> int:
    """Bytes one TCP stream keeps in flight once autotuning has opened its window: half the smaller of
    the receive and send buffers' autotuning maxima (the third fields of ``tcp_rmem`` and ``tcp_wmem``)
    on this machine, else :data:`FALLBACK_TCP_WINDOW` (Linux's defaults). A rough stand-in: give the
    window explicitly when you know the hosts' settings."""
    try:
        rmem = int((proc / "tcp_rmem").read_text().split()[2])
        wmem = int((proc / "tcp_wmem").read_text().split()[2])
    except (OSError, ValueError, IndexError):
        return FALLBACK_TCP_WINDOW
    return max(1, min(rmem, wmem) // 2)


def _positive(name: str, value: float, fix: str, allow_inf: bool = False) -> None:
    ok = value > 0 and (allow_inf or math.isfinite(value)) and not math.isnan(value)
    if not ok:
        kind = "a positive number (inf allowed)" if allow_inf else "a positive number"
        raise ValueError(f"{name} must be {kind}, got {value!r}: {fix}")


@dataclass(frozen=True)
class IslandSpec:
    """One island as the planner sees it.

    Args:
        devices: processes (GPUs) of the island; its leader is one of them.
        step_seconds: seconds per inner step (see :func:`~lightning_islands.plan.hardware.step_seconds`).
        intra_bytes_per_s: bytes per second the leader receives (and sends) inside the island when it
            gathers a fragment from its ranks and scatters the result back: one GPU's NVLink
            (~450 GB/s per direction on H100, ~900 GB/s on B200), its InfiniBand NIC (~50 GB/s) when
            the ranks are on other hosts, gloo over loopback on a CPU machine.
        leader_bytes_per_s: fp32 bytes per second of one pass of the codec or the merge on the leader
            (the Triton kernels reach ~300-500 GB/s on an H200, the CPU torch path ~1-2 GB/s per
            thread); the ranks' pseudo-gradient and outer step run at the same rate.
        steps_per_round: a fixed number of inner steps per ``sync_every`` (``members[i].steps_per_round``),
            else ``None``.
    """

    devices: int
    step_seconds: float
    intra_bytes_per_s: float = 450e9
    leader_bytes_per_s: float = 300e9
    steps_per_round: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.devices, int) or self.devices < 1:
            raise ValueError(f"an island needs devices >= 1 (processes), got {self.devices!r}")
        _positive("step_seconds", self.step_seconds,
                  "give each island's seconds per inner step (--step-seconds), or the FLOP/s to derive it")
        _positive("intra_bytes_per_s", self.intra_bytes_per_s,
                  "give the leader's bandwidth inside the island (--intra-gbps), e.g. 450 for NVLink", allow_inf=True)
        _positive("leader_bytes_per_s", self.leader_bytes_per_s,
                  "give the leader's codec throughput (--leader-gbps), e.g. 300 on a GPU", allow_inf=True)
        if self.steps_per_round is not None and self.steps_per_round < 1:
            raise ValueError(f"steps_per_round must be >= 1 or None, got {self.steps_per_round}")


@dataclass(frozen=True)
class LinkSpec:
    """The wide-area link between islands.

    Args:
        bps: bits per second each island's egress carries (a shaped veth with ``tbf``, or the share of
            a WAN link); ``math.inf`` for no limit.
        rtt_s: round-trip time between islands (and to the coordinator) in seconds.
        tcp_window_bytes: bytes one lane (one TCP stream) keeps in flight; a lane moves at most
            ``window / rtt``. ``None``: :func:`default_tcp_window`.
        store_rtt_s: round-trip time to the coordinator's store (``None``: ``rtt_s``).
        poll_s: the pause between two checks of the store while an island waits for the others'
            round headers (the transport sleeps 10 ms).
        ring_step_rtts: round trips of latency per step of a gloo ring all-gather (N - 1 steps for N
            islands); one by default, to be calibrated against measured runs.
    """

    bps: float
    rtt_s: float = 0.0
    tcp_window_bytes: float | None = None
    store_rtt_s: float | None = None
    poll_s: float = 0.01
    ring_step_rtts: float = 1.0

    def __post_init__(self) -> None:
        _positive("the link's bps", self.bps, "give the link's bits per second, e.g. --link-bps 25e9", allow_inf=True)
        for name in ("rtt_s", "poll_s", "ring_step_rtts"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.store_rtt_s is not None and not (self.store_rtt_s >= 0 and math.isfinite(self.store_rtt_s)):
            raise ValueError(f"store_rtt_s must be a finite number >= 0 or None, got {self.store_rtt_s!r}")
        if self.tcp_window_bytes is not None:
            _positive("tcp_window_bytes", self.tcp_window_bytes,
                      "give the bytes one TCP stream keeps in flight, e.g. --tcp-window-mib 64", allow_inf=True)

    @property
    def window(self) -> float:
        """Bytes in flight per lane (the given window, or this machine's default)."""
        return float(self.tcp_window_bytes) if self.tcp_window_bytes is not None else float(default_tcp_window())

    @property
    def store_rtt(self) -> float:
        """Round-trip time to the coordinator's store."""
        return self.rtt_s if self.store_rtt_s is None else self.store_rtt_s

    def rate_bps(self, streams: int) -> float:
        """Bits per second an island's egress moves with ``streams`` TCP streams sharing it: the link's
        rate, or the streams' windows over the round trip if those are smaller."""
        per_stream = math.inf if self.rtt_s == 0 else self.window * 8 / self.rtt_s
        return min(self.bps, streams * per_stream)


@dataclass(frozen=True)
class PlanInputs:
    """Everything one plan needs: the islands, the link, and the settings of ``islands.*``.

    Args:
        islands: one :class:`IslandSpec` per island, in island order.
        numel: values of the canonical vector (every parameter, MoE experts included): what a round
            exchanges, split into fragments.
        link: the link between islands.
        sync_every: H, inner steps between two syncs of the same fragment.
        fragments: F; a round syncs one fragment every ``H / F`` inner steps (``H % F == 0``).
        overlap_steps: tau; inner steps an island keeps taking while a round's exchange runs in the
            background (0: synchronous; at most ``H / F``).
        codec, block_size, error_feedback: the wire format (error feedback only adds the scatter of
            the residual); ``error_feedback=None`` is the codec's default.
        lanes: TCP streams per island pair.
        balance: ``"none"`` (every island runs ``H / F`` steps per round) or ``"time"`` (each runs the
            steps that fit the slowest island's ``H / F``, at most 8x).
        exchange_chunk_mib: the exchange moves the fragment in chunks of this many MiB of fp32, one
            after another (``None`` or 0: one chunk).
        fragment_sizes: values per fragment when they are not equal (see
            :func:`~lightning_islands.plan.fragments.fragment_sizes`); ``None``: equal.
        rounds: simulate a whole run of this many rounds from its start (to compare with a measured
            run); ``None``: steady state (a few fragment cycles after a warm-up).
        sync_warmup: H of each of the first rounds (``islands.sync_warmup``), then ``sync_every``.
        exchange_path: ``"leader"`` (every round passes through each island's rank 0) or
            ``"sliced"`` (``islands.exchange=sliced``: every rank exchanges its own slice over its own
            lanes, after an all-to-all inside the island, the codec work spread over its devices; the
            engine does not overlap it yet, the planner models that too).
        topology: ``"allreduce"`` (every island receives every other's payload, a ring all-gather)
            or ``"butterfly"`` (each island swaps its payload with its stage's partners only: one for
            a power of two, up to three otherwise).
        max_staleness: S; above 0 a round goes on without the islands not yet arrived once a majority
            (and ``min_islands``) has and the first of them has waited ``staleness_wait_s`` (else
            ``grace_s``); a late island joins the next round at once, without inner steps, and
            receives the global state there.
        grace_s: that wait (``None``: the engine's default, the island's last round, at least 10 s).
        staleness_wait_s: that wait instead of ``grace_s`` when given.
        min_islands: the fewest islands a round goes on with.
    """

    islands: tuple[IslandSpec, ...]
    numel: int
    link: LinkSpec
    sync_every: int = _ENGINE.sync_every
    fragments: int = _ENGINE.fragments
    overlap_steps: int = _ENGINE.overlap_steps
    codec: str = _ENGINE.codec
    block_size: int = _ENGINE.block_size
    error_feedback: bool | None = _ENGINE.error_feedback
    lanes: int = _ENGINE.lanes
    balance: str = _ENGINE.balance
    exchange_chunk_mib: float | None = _ENGINE.exchange_chunk_mib
    fragment_sizes: tuple[int, ...] | None = None
    rounds: int | None = None
    sync_warmup: tuple[int, ...] = ()
    exchange_path: str = "leader"
    topology: str = _ENGINE.topology
    max_staleness: int = _ENGINE.max_staleness
    grace_s: float | None = _ENGINE.grace_s
    staleness_wait_s: float | None = _ENGINE.staleness_wait_s
    min_islands: int = _ENGINE.min_islands
    _codec: Codec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "islands", tuple(self.islands))
        if not self.islands:
            raise ValueError("a plan needs at least one island (islands.members)")
        if not isinstance(self.numel, int) or self.numel < 1:
            raise ValueError(f"numel (the model's parameters) must be an int >= 1, got {self.numel!r}: give --params")
        h, f, tau = self.sync_every, self.fragments, self.overlap_steps
        if h < 1:
            raise ValueError(f"islands.sync_every (H) must be >= 1, got {h}")
        if f < 1:
            raise ValueError(f"islands.fragments (F) must be >= 1, got {f}")
        if h % f:
            raise ValueError(f"islands.sync_every (H={h}) must be a multiple of islands.fragments (F={f}): a fragment "
                             f"syncs every H/F inner steps; e.g. H={h + (f - h % f)} or a fragment count dividing {h}")
        if not 0 <= tau <= h // f:
            raise ValueError(f"islands.overlap_steps (tau={tau}) must be between 0 and H/F = {h // f}: one fragment is "
                             "in flight at a time; lower it, or raise H or lower F")
        if self.lanes < 1:
            raise ValueError(f"islands.lanes must be >= 1, got {self.lanes}")
        if self.balance not in ("none", "time"):
            raise ValueError(f"islands.balance must be 'none' or 'time', got {self.balance!r}")
        if self.exchange_chunk_mib is not None and not (self.exchange_chunk_mib >= 0
                                                        and math.isfinite(self.exchange_chunk_mib)):
            raise ValueError(f"islands.exchange_chunk_mib must be >= 0 (0: one chunk), got {self.exchange_chunk_mib}")
        if self.rounds is not None and self.rounds < 1:
            raise ValueError(f"rounds must be >= 1 (or None for the steady state), got {self.rounds}")
        if self.exchange_path not in EXCHANGE_PATHS:
            raise ValueError(f"exchange_path must be one of {EXCHANGE_PATHS}, got {self.exchange_path!r}")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"islands.topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if self.max_staleness < 0 or (self.max_staleness and tau):
            raise ValueError(f"islands.max_staleness must be >= 0 and does not combine with overlap_steps, got "
                             f"S={self.max_staleness}, tau={tau}")
        if self.grace_s is not None and not (self.grace_s > 0 and math.isfinite(self.grace_s)):
            raise ValueError(f"islands.grace_s must be > 0 or null, got {self.grace_s!r}")
        if self.min_islands < 1:
            raise ValueError(f"islands.min_islands must be >= 1, got {self.min_islands}")
        warmup = tuple(self.sync_warmup or ())
        if any(w < 1 for w in warmup):
            raise ValueError(f"islands.sync_warmup must hold H values >= 1, got {list(warmup)}")
        object.__setattr__(self, "sync_warmup", warmup)
        if self.fragment_sizes is not None:
            sizes = tuple(int(s) for s in self.fragment_sizes)
            if len(sizes) != f or min(sizes) < 1 or sum(sizes) != self.numel:
                raise ValueError(f"fragment_sizes must hold F={f} sizes >= 1 that add up to numel={self.numel}, "
                                 f"got {len(sizes)} adding up to {sum(sizes)}")
            object.__setattr__(self, "fragment_sizes", sizes)
        try:
            codec = make_codec(self.codec, block_size=self.block_size)
        except (TypeError, ValueError) as err:
            raise ValueError(f"islands.codec: {err}") from None
        object.__setattr__(self, "_codec", codec)

    @property
    def num_islands(self) -> int:
        """How many islands take part."""
        return len(self.islands)

    @property
    def peers(self) -> int:
        """Payloads an island receives per round: ``N - 1``, or its butterfly partners (the most of
        any island: groups of a count that is not a power of two hold up to four islands)."""
        n = self.num_islands
        if self.topology != "butterfly" or n < 2:
            return n - 1
        bf = Butterfly(n)
        return max(len(bf.peers(i, 0)) for i in range(n))

    @property
    def codec_obj(self) -> Codec:
        """The wire format (its ``nbytes`` gives the payload sizes)."""
        return self._codec

    @property
    def use_error_feedback(self) -> bool:
        """Whether the residual is kept (and scattered back to the ranks every round)."""
        return default_error_feedback(self._codec) if self.error_feedback is None else bool(self.error_feedback)

    @property
    def streams(self) -> int:
        """TCP streams an island's egress carries at once: its lanes (times the ranks of the smallest
        island when every rank exchanges its own slice)."""
        sliced = self.exchange_path == "sliced"
        return self.lanes * (min(i.devices for i in self.islands) if sliced else 1)

    def fragment_numel(self, round_index: int) -> int:
        """Values of the fragment round ``round_index`` syncs (fragment ``round_index % F``)."""
        f = round_index % self.fragments
        if self.fragment_sizes is not None:
            return self.fragment_sizes[f]
        base, extra = divmod(self.numel, self.fragments)
        return base + (1 if f < extra else 0)


def with_link(inputs: PlanInputs, bps: float) -> PlanInputs:
    """The same plan over a link of ``bps`` bits per second (everything else kept)."""
    return replace(inputs, link=replace(inputs.link, bps=bps))


def island_specs(devices: Sequence[int], step_seconds: Sequence[float], intra_bytes_per_s: Sequence[float],
                 leader_bytes_per_s: Sequence[float],
                 steps_per_round: Sequence[int | None] | None = None) -> tuple[IslandSpec, ...]:
    """One :class:`IslandSpec` per island from per-island lists (all of one length)."""
    n = len(devices)
    fixed = list(steps_per_round) if steps_per_round is not None else [None] * n
    lists = {"step_seconds": step_seconds, "intra_bytes_per_s": intra_bytes_per_s,
             "leader_bytes_per_s": leader_bytes_per_s, "steps_per_round": fixed}
    for name, values in lists.items():
        if len(values) != n:
            raise ValueError(f"{name}: {len(values)} values for {n} islands; give one per island (islands.members)")
    return tuple(IslandSpec(int(d), float(s), float(i), float(c), p)
                 for d, s, i, c, p in zip(devices, step_seconds, intra_bytes_per_s, leader_bytes_per_s, fixed))
