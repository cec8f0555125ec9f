"""A shaped link on one machine: each island in its own Linux network namespace behind a veth pair
whose egress the kernel shapes with ``tc``.

Topology, for a run of N islands::

    namespace li-PID-SEQ-i0           namespace li-PID-SEQ-hub              namespace li-PID-SEQ-i1
    lo (the island's own ranks)       bridge li-br 10.A.B.1 (coordinator)   lo (the island's own ranks)
    li-i0 10.A.B.2 --[veth, shaped]-- li-h0 ---+--- li-h1 --[veth, shaped]-- li-i1 10.A.B.3

- **A hub namespace holding a bridge**, rather than a bridge in the root namespace: every address the
  run creates lives inside namespaces the run created, the machine's own namespace gains neither an
  address nor a route (so nothing on it can route into the islands, and nothing leads from them off
  the machine), and deleting the namespaces removes every device with them. The coordinator, which
  the launcher serves from its own process, listens inside the hub namespace: :func:`run_in_namespace`
  creates its socket from a thread that joined the hub namespace for that moment (a socket belongs to
  the namespace it was created in; the process itself stays where it is). Namespace names carry the
  creating pid and a per-process counter; devices (``li-iN``, ``li-hN``, ``li-br``, at most 15
  characters) are created directly inside their namespaces, so they need to be unique only there.
- **One private /24 per run** (``10.A.B.0/24``, picked to overlap no address or route of the machine
  or of other namespaces): the bridge joins every island at layer 2, so a single subnet needs no
  routing and no forwarding sysctl. An island namespace has only ``lo`` and its veth, and no default
  route: it reaches the other islands and the hub, nothing else.
- **Shaped in both directions**: ``tbf`` on the egress of the island end (island -> hub) and of the
  hub end (hub -> island) of every veth. Between two islands a byte crosses two shapers of the same
  rate, so each direction runs at the rate and both directions at once (an all-gather) at the rate
  each. Inside an island, traffic between its processes goes over ``lo`` (even when addressed to the
  veth's own address, which Linux delivers locally), so it is never shaped. An island given a rate
  of its own (``1gbit,100ms,3=200mbit``) has both shapers of its veth at that rate: it talks to every
  other island at the smaller of their two rates (a site behind a slower uplink).
- **Delay where the kernel has netem** (detected by trying on the first veth): half the RTT on the
  hub end of every veth, the one qdisc a packet crosses on its way into an island, so the islands
  are ``RTT`` apart and the coordinator at the hub ``RTT / 2`` from each. Not on the island end: a
  packet held in its sender's own qdisc still counts against the socket's TCP Small Queues budget
  (about 1 ms of its pacing rate), which would throttle the sender to that budget per delay; past
  the veth it no longer does (measured: with 1.9 MB queued at a hub end, the sending socket's
  ``sk_wmem_alloc`` was 0). netem is the root qdisc there and tbf its child (the order
  ``tc-netem(8)`` gives for delay plus rate).
- **Delay where it is missing: a delay line** (:mod:`lightning_islands.app.delayline`): each island
  namespace gets a TUN device ``li-dN`` and a policy rule (``iif lo lookup 100``) whose table sends
  every packet the island's own processes address to the hub subnet through it; a process started
  with the link holds each packet ``RTT / 2`` and writes it back, and the kernel forwards it out of
  the veth and its tbf (``ip_forward`` and ``accept_local`` on in the island namespace). So the
  delay sits on the island ends here, before the same shaper: islands are ``RTT`` apart, the
  coordinator ``RTT / 2`` from each, as with netem; packets, not connections, are delayed, so TCP's
  own windows and congestion control meet the RTT. ``shaped_link(..., delay="tun")`` asks for it
  where netem exists too; :meth:`ShapedLink.describe` says which one is in effect.
- **tbf sizing**: ``burst`` (the token bucket) is the larger of 10 ms at the rate and 64 KiB + 2 KiB,
  so a 64 KiB GSO packet passes whole (tbf would otherwise cut it into MTU-sized segments, costing CPU
  on a small machine), and a dequeue that a busy machine delays by up to 10 ms loses no tokens (on
  a loaded 2-core VM, streams ran at 0.89-0.95 of the rate with a 2 ms bucket, 0.93-0.96 with 10
  ms); the excess it lets through is one bucket, 1 % of a second. ``limit`` (the queue before
  drops) is the bucket plus the bandwidth-delay product at ``max(RTT, 20 ms)``: one BDP of buffer
  is what a single TCP flow needs to keep a bottleneck busy, and 20 ms keeps a rate-only link from
  dropping on bursts. tbf counts whole frames (headers too), so a TCP stream's payload reaches
  ~95.6 % of the rate with 1500-byte frames (1448 payload bytes per 1514).

Every ``ip``/``tc`` call has a timeout. The namespaces are deleted when :func:`shaped_link` ends,
also by an exception, SIGINT or SIGTERM (turned into ``SystemExit`` while the link is up, when no
other handler is set); those of runs whose process died (names carry the creating pid) are swept
when the next link is made. Root and ``ip``/``tc`` (iproute2) are needed: :func:`link_problem` says
what is missing.
"""

from __future__ import annotations

import ctypes
import ipaddress
import itertools
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from lightning_islands.app import rates

T = TypeVar("T")

PREFIX = "li-"
NETNS_DIR = "/var/run/netns"  # where `ip netns` keeps its names (a bind mount per namespace)
CALL_TIMEOUT_S = 15.0  # every ip/tc call
BRIDGE = "li-br"
_NAME = re.compile(r"^li-(\d+)-(\d+)-(hub|i\d+)$")
_CLONE_NEWNET = 0x40000000
_SEQ = itertools.count()
_SEQ_LOCK = threading.Lock()

_SPEC_UNITS = (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1))  # LinkSpec's text
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "secs": 1.0, "ms": 1e-3, "msec": 1e-3, "msecs": 1e-3,
               "us": 1e-6, "usec": 1e-6, "usecs": 1e-6}
_FORM = ("RATE[,RTT][,tuned][,ISLAND=RATE...], RATE in bits per second, e.g. 1gbit,100ms or 200mbit or "
         "1gbit,100ms,tuned or 1gbit,100ms,3=200mbit (island 3 behind 200 Mbit/s)")
TCP_HOSTS = ("default", "tuned")  # the island namespaces' TCP: as a new namespace has it, or TUNED_TCP
# what an operator sets on the leaders' hosts of a long-fat link: send buffers that may grow to the
# bandwidth-delay product (32 MiB: 1 Gbit/s at 250 ms), and no return to slow start between rounds
TUNED_TCP = {"net.ipv4.tcp_wmem": "4096 16384 33554432", "net.ipv4.tcp_rmem": "4096 131072 33554432",
             "net.ipv4.tcp_slow_start_after_idle": "0"}


DELAYS = ("auto", "netem", "tun")  # how the RTT is made: netem where the kernel has it, else the delay line
DELAY_TABLE = "100"  # the routing table of an island namespace that leads through its delay line


class LinkUnavailable(RuntimeError):
    """This machine cannot make a shaped link (not root, or ``ip``/``tc`` missing)."""


# ----------------------------------------------------------------------------------------- parsing
def parse_rate(text: str) -> int:
    """A link rate in bits per second, as :func:`lightning_islands.app.rates.parse_rate` reads it
    (``1gbit``, ``200mbit``, ``25G``, ``25e9``; ``25gbps`` and other byte-ish units are refused)."""
    try:
        bps = round(rates.parse_rate(text))
    except ValueError as err:
        raise ValueError(f"{err}; give the link as {_FORM}") from None
    if bps < 8_000:
        raise ValueError(f"link rate {text!r} is below 8kbit; give the link as {_FORM}")
    return bps


def parse_duration(text: str) -> float:
    """A tc time (``100ms``, ``0.1s``, ``250us``) in seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _TIME_UNITS:
        raise ValueError(f"link RTT {text!r} is not a number with a time unit (s, ms, us); give the link as {_FORM}")
    seconds = float(m.group(1)) * _TIME_UNITS[unit]
    if seconds > 10.0:
        raise ValueError(f"link RTT {text!r} is above 10 s; give the link as {_FORM}")
    return seconds


def format_rate(bps: float) -> str:
    """``1e9`` -> ``"1 Gbit/s"``."""
    for scale, unit in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


@dataclass(frozen=True)
class LinkSpec:
    """What the link between islands should be: a rate each way, a round-trip time (0: none), the
    islands' host TCP (``"default"``, or ``"tuned"``: :data:`TUNED_TCP` in their namespaces) and
    the islands that sit behind a rate of their own (``island_rates``: ``(island, rate_bps)`` pairs,
    in island order). An island's rate holds both ways on its own veth, so two islands talk at the
    smaller of their two rates."""

    rate_bps: int
    rtt_s: float = 0.0
    tcp: str = "default"
    island_rates: tuple[tuple[int, int], ...] = ()

    def rate_of(self, island: int) -> int:
        """The rate of island ``island``'s own end of the link, each way."""
        return dict(self.island_rates).get(island, self.rate_bps)

    def max_rate(self, num_islands: int) -> int:
        """The fastest island end among ``num_islands`` islands."""
        return max(self.rate_of(i) for i in range(num_islands))

    def __str__(self) -> str:
        rtt = f",{self.rtt_s * 1e3:g}ms" if self.rtt_s else ""
        tcp = f",{self.tcp}" if self.tcp != "default" else ""
        own = "".join(f",{i}={_spec_rate(bps)}" for i, bps in self.island_rates)
        return f"{_spec_rate(self.rate_bps)}{rtt}{tcp}{own}"


def _spec_rate(bps: int) -> str:
    unit, scale = next((u, scale) for u, scale in _SPEC_UNITS if bps % scale == 0)
    return f"{bps // scale}{unit}"


def parse_link(spec: str | LinkSpec) -> LinkSpec:
    """``"1gbit,100ms"``, ``"200mbit"`` or ``"1gbit,100ms,tuned"`` -> :class:`LinkSpec`; a ValueError
    names the accepted form."""
    if isinstance(spec, LinkSpec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"link {spec!r} is empty; give it as {_FORM}")
    parts = [p.strip() for p in spec.split(",")]
    own: dict[int, int] = {}
    while len(parts) > 1 and "=" in parts[-1]:
        island, _, rate = parts.pop().partition("=")
        if not island.strip().isdigit():
            raise ValueError(f"link {spec!r}: {island.strip()!r} before '=' is not an island index; give the link as "
                             f"{_FORM}")
        if int(island) in own:
            raise ValueError(f"link {spec!r} gives island {int(island)} two rates; give the link as {_FORM}")
        own[int(island)] = parse_rate(rate)
    tcp = parts.pop() if len(parts) > 1 and parts[-1].lower() in TCP_HOSTS else "default"
    if len(parts) > 2 or any("=" in p for p in parts):
        raise ValueError(f"link {spec!r} has too many parts, or its parts out of order; give it as {_FORM}")
    rate = parse_rate(parts[0])
    rtt = parse_duration(parts[1]) if len(parts) == 2 else 0.0
    return LinkSpec(rate, rtt, tcp.lower(), tuple(sorted(own.items())))


def tbf_sizes(rate_bps: int, rtt_s: float = 0.0) -> tuple[int, int]:
    """``(burst, limit)`` in bytes for tbf at ``rate_bps`` (see the module docstring for why)."""
    burst = max(66 * 1024, int(rate_bps * 0.010 / 8))
    limit = burst + int(rate_bps * max(rtt_s, 0.020) / 8)
    return burst, limit


# ----------------------------------------------------------------------------------------- commands
def link_problem() -> str | None:
    """Why this machine cannot make a shaped link (``None`` when it can)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    needs = []
    if os.geteuid() != 0:
        needs.append("root (network namespaces and tc need CAP_NET_ADMIN; run as root, e.g. with sudo)")
    if missing:
        needs.append(f"{' and '.join(missing)} from iproute2 (e.g. `apt-get install iproute2`)")
    if not needs:
        return None
    return "a shaped link (--link / islands.link) needs " + "; and ".join(needs)


def check_link_support() -> None:
    """Raise :class:`LinkUnavailable` saying what is needed when :func:`link_problem` finds something."""
    problem = link_problem()
    if problem:
        raise LinkUnavailable(problem)


def _run(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=CALL_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"`{' '.join(args)}` did not finish within {CALL_TIMEOUT_S:g} s") from err
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def namespaces() -> list[str]:
    """The names of every network namespace ``ip netns`` knows."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the namespaces of links whose creating process is gone (a run killed before its
    teardown); returns their names."""
    gone = []
    for name in namespaces():
        m = _NAME.match(name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _run(["ip", "netns", "del", name], check=False)
            gone.append(name)
    return gone


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network that an address or route of this machine or of a named namespace covers."""
    texts = [_run(["ip", "-4", "-o", "addr", "show"], check=False).stdout,
             _run(["ip", "-4", "route", "show", "table", "all"], check=False).stdout]
    texts += [_run(["ip", "-n", ns, "-4", "-o", "addr", "show"], check=False).stdout for ns in namespaces()]
    nets = []
    for cidr in re.findall(r"(?<![\d.])(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", "\n".join(texts)):
        try:
            nets.append(ipaddress.IPv4Network(cidr, strict=False))
        except ValueError:
            continue
    return nets


def pick_subnet(seed: int = 0) -> ipaddress.IPv4Network:
    """A free ``10.A.B.0/24`` (A in 200..254) that overlaps no address or route here."""
    used = _used_networks()
    candidates = [(a, b) for a in range(200, 255) for b in range(256)]
    start = seed % len(candidates)
    for a, b in candidates[start:] + candidates[:start]:
        net = ipaddress.IPv4Network(f"10.{a}.{b}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.A.B.0/24 (A in 200..254) for the link; remove stale namespaces (ip netns list)")


# ----------------------------------------------------------------------------------------- namespaces
def _setns(fd: int) -> None:
    if hasattr(os, "setns"):
        os.setns(fd, _CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextmanager
def entered(namespace: str) -> Iterator[None]:
    """Move the calling thread (only it) into network namespace ``namespace`` for the body: sockets
    it creates there belong to that namespace for their whole life. Needs root."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(os.path.join(NETNS_DIR, namespace), os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


def interface_bytes(interface: str) -> int:
    """Bytes received plus sent so far by ``interface`` of the calling thread's network namespace
    (``/proc/thread-self/net/dev``): whether traffic crossed a link, whatever the machine's speed."""
    for line in Path("/proc/thread-self/net/dev").read_text().splitlines()[2:]:
        name, _, counters = line.partition(":")
        if name.strip() == interface:
            fields = counters.split()
            return int(fields[0]) + int(fields[8])
    raise LookupError(f"no interface {interface} in this namespace's /proc/net/dev")


def run_in_namespace(namespace: str, fn: Callable[[], T]) -> T:
    """``fn()`` run by a fresh thread inside ``namespace``; returns its result or raises its error.
    The calling thread never changes namespace."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            with entered(namespace):
                box["result"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            box["error"] = err

    thread = threading.Thread(target=work, name=f"netns-{namespace}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


@dataclass(frozen=True)
class IslandPort:
    """One island's end of the link: its namespace, its veth there and that veth's address."""

    island: int
    namespace: str
    interface: str
    address: str


@dataclass(frozen=True)
class ShapedLink:
    """A link made by :func:`shaped_link`: where each island runs and how the link is shaped."""

    spec: LinkSpec
    tag: str
    hub_namespace: str
    hub_address: str
    subnet: str
    islands: tuple[IslandPort, ...]
    netem: bool  # whether netem makes the asked RTT
    delay_line: tuple[str, ...] = ()  # else NAMESPACE:DEVICE of each island's TUN, when a delay line makes it

    @property
    def rtt_s(self) -> float:
        """The RTT between islands that the link adds (0 when none was asked)."""
        return self.spec.rtt_s if self.netem or self.delay_line else 0.0

    @property
    def delay(self) -> str:
        """What makes the RTT: ``"netem"``, ``"delay line"`` or ``"none"``."""
        return "netem" if self.netem else "delay line" if self.delay_line else "none"

    def exec_prefix(self, island: int) -> list[str]:
        """Prefix a command with this to run it inside island ``island``'s namespace."""
        return ["ip", "netns", "exec", self.islands[island].namespace]

    def describe(self) -> str:
        """One line for logs: the rate, the RTT (or why there is none), the namespaces, the hub."""
        rate = f"{format_rate(self.spec.rate_bps)} each way (tbf)"
        if self.spec.island_rates:
            rate += "; " + ", ".join(f"island {i} behind {format_rate(bps)}" for i, bps in self.spec.island_rates)
        if not self.spec.rtt_s:
            delay = "no added delay (none asked)"
        else:
            how = "netem" if self.netem else "a TUN delay line per island: this kernel has no netem"
            delay = (f"RTT {self.spec.rtt_s * 1e3:g} ms between islands ({how}), "
                     f"{self.spec.rtt_s * 500:g} ms to the coordinator")
        tcp = "; island TCP tuned (32 MiB buffers, no slow start after idle)" if self.spec.tcp == "tuned" else ""
        return (f"link {self.spec}: {rate}, {delay}{tcp}; islands in namespaces "
                f"{self.tag}-i0..{len(self.islands) - 1}, coordinator at {self.hub_address} in {self.hub_namespace} "
                f"({self.subnet})")


def _qdiscs(namespace: str, device: str, rate_bps: int, rtt_s: float, delay_s: float) -> bool:
    """Shape ``device``'s egress to ``rate_bps`` (its queue sized for ``rtt_s``), with ``delay_s``
    of netem delay before it when asked; returns whether the delay was set (False when the kernel
    lacks netem: then tbf alone)."""
    burst, limit = tbf_sizes(rate_bps, rtt_s)
    tbf = ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "limit", str(limit)]
    tc = ["tc", "-n", namespace, "qdisc", "add", "dev", device]
    if delay_s > 0:
        # room for every packet the delay holds: full frames at the rate, four times over for small ones
        packets = max(10_000, 4 * int(rate_bps * delay_s / 8 / 1500))
        done = _run(tc + ["root", "handle", "1:", "netem", "delay", f"{max(1, round(delay_s * 1e6))}us",
                          "limit", str(packets)], check=False)
        if done.returncode == 0:
            _run(tc + ["parent", "1:1", "handle", "10:"] + tbf)
            return True
        if "unknown" not in (done.stderr + done.stdout).lower():
            raise RuntimeError(f"tc netem on {device} in {namespace} failed: {done.stderr.strip()}")
    _run(tc + ["root", "handle", "1:"] + tbf)
    return False


def write_sysctls(values: dict[str, str]) -> None:
    """Write ``/proc/sys`` keys (``net.ipv4.ip_forward`` style) in the calling thread's network
    namespace (its own copy of the ``net.*`` keys)."""
    for key, value in values.items():
        with open(f"/proc/sys/{key.replace('.', '/')}", "w") as f:
            f.write(value)


def _route_through_delay_line(port: IslandPort, subnet: str) -> str:
    """Give island ``port`` a TUN that every packet its processes send off the island crosses;
    returns ``NAMESPACE:DEVICE`` for the delay line (see the module docstring)."""
    ns, dev = port.namespace, f"li-d{port.island}"
    _run(["ip", "-n", ns, "tuntap", "add", "dev", dev, "mode", "tun", "vnet_hdr"])
    _run(["ip", "-n", ns, "link", "set", "dev", dev, "up"])
    # packets come back from the TUN with the island's own source address, to be forwarded
    run_in_namespace(ns, lambda: write_sysctls({
        "net.ipv4.ip_forward": "1", "net.ipv4.conf.all.rp_filter": "0", f"net.ipv4.conf.{dev}.rp_filter": "0",
        f"net.ipv4.conf.{dev}.accept_local": "1"}))
    _run(["ip", "-n", ns, "route", "add", subnet, "dev", dev, "src", port.address, "table", DELAY_TABLE])
    _run(["ip", "-n", ns, "rule", "add", "iif", "lo", "lookup", DELAY_TABLE, "pref", "100"])
    return f"{ns}:{dev}"


def _build(tag: str, num_islands: int, spec: LinkSpec, seed: int, delay: str = "auto") -> ShapedLink:
    subnet = pick_subnet(seed)
    hosts = list(subnet.hosts())
    hub, hub_addr = f"{tag}-hub", str(hosts[0])
    _run(["ip", "netns", "add", hub])
    _run(["ip", "-n", hub, "link", "set", "dev", "lo", "up"])
    _run(["ip", "-n", hub, "link", "add", "name", BRIDGE, "type", "bridge"])
    _run(["ip", "-n", hub, "addr", "add", f"{hub_addr}/{subnet.prefixlen}", "dev", BRIDGE])
    _run(["ip", "-n", hub, "link", "set", "dev", BRIDGE, "up"])
    ports, netem = [], bool(spec.rtt_s) and delay != "tun"
    for i in range(num_islands):
        ns, inner, outer, addr = f"{tag}-i{i}", f"li-i{i}", f"li-h{i}", str(hosts[i + 1])
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "set", "dev", "lo", "up"])
        # both ends are made inside their namespaces: the machine's own namespace never sees them
        _run(["ip", "link", "add", "name", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", hub])
        _run(["ip", "-n", hub, "link", "set", "dev", outer, "master", BRIDGE])
        _run(["ip", "-n", hub, "link", "set", "dev", outer, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{addr}/{subnet.prefixlen}", "dev", inner])
        _run(["ip", "-n", ns, "link", "set", "dev", inner, "up"])
        if spec.tcp == "tuned":  # per network namespace: the machine's own TCP is untouched
            run_in_namespace(ns, lambda: write_sysctls(TUNED_TCP))
        rate = spec.rate_of(i)
        _qdiscs(ns, inner, rate, spec.rtt_s, 0.0)  # island -> hub: the rate only (see the module docstring)
        netem = _qdiscs(hub, outer, rate, spec.rtt_s, spec.rtt_s / 2 if netem else 0.0)  # hub -> island: and delay
        if delay == "netem" and spec.rtt_s and not netem:
            raise LinkUnavailable("delay='netem' asked, but this kernel has no netem qdisc; use delay='auto' or "
                                  "delay='tun' (a delay line), or a kernel with sch_netem")
        ports.append(IslandPort(i, ns, inner, addr))
    tuns = ()
    if spec.rtt_s and not netem:
        tuns = tuple(_route_through_delay_line(port, str(subnet)) for port in ports)
    return ShapedLink(spec, tag, hub, hub_addr, str(subnet), tuple(ports), netem=bool(spec.rtt_s) and netem,
                      delay_line=tuns)


def delay_line_limit(spec: LinkSpec, num_islands: int = 1) -> int:
    """Bytes the delay line may hold per island: eight times what the delay holds at the fastest
    island's rate, at least 64 MiB (the bottleneck's drops belong to tbf's queue, not to the delay)."""
    held = spec.max_rate(num_islands) / 8 * spec.rtt_s / 2  # bytes in flight through one delay of RTT / 2
    return max(64 << 20, int(8 * held))


@contextmanager
def _delay_line(link: ShapedLink) -> Iterator[None]:
    """Run the delay line process for ``link`` (when it has one) for the body."""
    if not link.delay_line:
        yield
        return
    cmd = [sys.executable, "-m", "lightning_islands.app.delayline", "--delay-s", repr(link.spec.rtt_s / 2),
           "--limit-bytes", str(delay_line_limit(link.spec, len(link.islands))), *link.delay_line]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], CALL_TIMEOUT_S)
        if not ready or proc.stdout.readline().strip() != "ready":
            proc.kill()
            raise RuntimeError(f"the delay line for link {link.spec} did not start: "
                               f"{proc.communicate(timeout=CALL_TIMEOUT_S)[1].strip()[-2000:] or 'no message'}")
        yield
    finally:
        if proc.poll() is None:
            try:  # closing its stdin (communicate does) is its signal to end
                _, err = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if proc.returncode not in (0, -signal.SIGKILL):
                print(f"the delay line of link {link.spec} ended with {proc.returncode}: {err.strip()[-2000:]}",
                      file=sys.stderr)


def _kill_inside(namespace: str) -> None:
    """SIGKILL whatever still runs inside one of this link's island namespaces (never this process)."""
    out = _run(["ip", "netns", "pids", namespace], check=False).stdout
    for pid in (int(p) for p in out.split() if p.isdigit()):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def remove(tag: str, num_islands: int) -> None:
    """Delete the namespaces of the link ``tag`` (their devices go with them), killing what still
    runs inside an island's; idempotent: a name that does not exist is skipped."""
    for name in [f"{tag}-i{i}" for i in range(num_islands)] + [f"{tag}-hub"]:
        if os.path.exists(os.path.join(NETNS_DIR, name)):
            if not name.endswith("-hub"):
                _kill_inside(name)
            _run(["ip", "netns", "del", name], check=False)


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM while the body (a teardown) runs; re-raise the first one after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if caught:
        if caught[0] == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + caught[0])


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While the body runs, SIGTERM raises SystemExit (so ``finally`` blocks run), unless the
    program already handles it; main thread only."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def shaped_link(spec: str | LinkSpec, num_islands: int, delay: str = "auto") -> Iterator[ShapedLink]:
    """Make the namespaces, veths and qdiscs of a link between ``num_islands`` islands for the body;
    remove them after it, however it ends. Raises :class:`LinkUnavailable` without root or iproute2.

    ``delay`` says what makes the RTT: ``"auto"`` (netem where the kernel has it, else a delay line),
    ``"netem"`` (else :class:`LinkUnavailable`) or ``"tun"`` (the delay line).

    Run a command in island ``i`` with :meth:`ShapedLink.exec_prefix`, serve the coordinator with
    :func:`run_in_namespace` on :attr:`ShapedLink.hub_namespace` at :attr:`ShapedLink.hub_address`.
    """
    spec = parse_link(spec)
    if delay not in DELAYS:
        raise ValueError(f"delay {delay!r} is not one of {', '.join(DELAYS)}")
    if not 1 <= num_islands <= 250:
        raise ValueError(f"a shaped link joins 1 to 250 islands, not {num_islands}")
    beyond = [i for i, _ in spec.island_rates if i >= num_islands]
    if beyond:
        raise ValueError(f"link {spec} gives island {beyond[0]} a rate of its own, but the run has {num_islands} "
                         f"islands (0..{num_islands - 1}); drop ',{beyond[0]}=...' or add islands")
    check_link_support()
    sweep_stale()
    with _SEQ_LOCK:
        seq = next(_SEQ)
    tag = f"{PREFIX}{os.getpid()}-{seq}"
    with _sigterm_raises():
        try:
            link = _build(tag, num_islands, spec, seed=os.getpid() * 31 + seq, delay=delay)
            with _delay_line(link):
                yield link
        finally:
            with _signals_deferred():
                remove(tag, num_islands)
