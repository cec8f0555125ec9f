"""Throughput of the lanes over a shaped link, and what latency costs a round.

    python benchmarks/lanes.py --out results/lanes            # 1, 2, 4, 8 lanes, 300 MB, 1gbit[,100ms]
    python benchmarks/lanes.py --quick --out /tmp/lanes       # lanes 1 and 2, 8 MB, 200mbit

Two islands of one process each run in network namespaces joined by a link shaped with tc
(``lightning-islands run --link``; root and iproute2 needed, see lightning_islands/app/netns.py):
1 Gbit/s each way and an RTT of 100 ms (netem where the kernel has it, else the link's TUN delay
line, lightning_islands/app/delayline.py). For each host TCP setting (``--tcp``: the namespaces'
defaults, and ``tuned``: send buffers that may grow to 32 MiB and no slow start after idle, what an
operator sets on a long-fat link) and each lane count, each island's leader all-gathers one payload
of ``--payload-mb`` MB with ``IslandLink.all_gather_bytes`` (what a round does per exchange chunk)
twice, a round's gap (1 s) apart: the first round on new connections, then the next round, which
is what every later round of a training run meets. The time is from the start of the all-gather to
its end on the slower island. ``ratio`` is the achieved payload rate over the shaped rate: at most
~0.956 with 1500-byte frames, since tbf counts every frame's 66 header bytes (Ethernet, IP, TCP
with timestamps) against the rate. Beside it, for the first setting, the same bytes with gloo
send/recv into buffers touched beforehand: on the lanes (duplex: with two islands each lane's
connection carries both directions, as in the all-gather) and on one gloo group per lane and
direction (split). Measured here (docs/BENCHMARKS.md).

What latency costs a round (read from lightning_islands/engine/round.py and transport.py; the
counts are measured by this script, through a proxy that delays the coordinator's traffic):

1. **The header gather** (``IslandLink.gather_objects``, once per round): store round trips to the
   coordinator, ``RTT_c`` each. Measured costs of the c10d TCPStore ops: ``set`` 0 (no reply
   awaited), ``check`` and ``add`` 1, ``get`` 2 (a wait, then the get). With every island already
   there: 1 set, a check and a get per island (heartbeats), 1 check, a get per island: 5N + 1
   round trips (11 for two islands); every 10 ms poll while waiting adds N (a check for each other
   island's abort, one for the keys). The coordinator at the hub is RTT/2 from each island here; on
   real sites it sits at one of them (RTT_c = 0 there, the full RTT from the other).
2. **Per exchange chunk** (``islands.exchange_chunk_mib`` of fp32; one chunk for up to 268M
   parameters at the default 1024 MiB): the sizes all-gather on lane 0, then the payload all-gather
   on every lane in parallel. A gloo all-gather is a ring of N - 1 steps; a step costs one one-way
   delay plus ``payload / lanes / rate`` when each lane's TCP window holds ``BDP / lanes`` (BDP =
   rate x RTT), and ``payload / lanes / (window / RTT)`` when it does not.
3. **Slow start**: rounds are apart longer than TCP's retransmission timeout, so with the Linux
   default ``net.ipv4.tcp_slow_start_after_idle = 1`` each round's transfer starts again from the
   initial window of 10 segments and needs about ``log2(window / 10 MSS)`` RTTs to reach its window
   (~10 RTTs = 1 s for one lane at 1 Gbit/s and 100 ms). Setting it to 0 on the leaders' hosts
   keeps the window across rounds.

The window each lane needs is ``rate x RTT / 8 / lanes`` bytes: 12.5 MB for one lane at 1 Gbit/s
and 100 ms, 1.56 MB for eight. Linux grows a connection's send buffer only up to
``net.ipv4.tcp_wmem[2]`` (4 MiB by default) and its receive buffer up to ``tcp_rmem[2]``; the script
reads both inside the island namespaces, and samples each lane's send buffer, cwnd and RTT with
``ss`` during the transfer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import zlib
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RTT_OPS = ("set", "check", "get", "add", "compare_set", "multi_get")


# ------------------------------------------------------------------------------------------ island side
def _sample_sockets(skip: set[str], stop: threading.Event, found: dict) -> None:
    """Every 0.25 s, the largest send buffer, receive buffer, cwnd and RTT of the TCP sockets whose
    peer is not in ``skip`` (the coordinator) nor on loopback: the lanes."""
    while not stop.wait(0.25):
        try:
            out = subprocess.run(["ss", "-tmin", "state", "established"], capture_output=True, text=True,
                                 timeout=5).stdout
        except (OSError, subprocess.TimeoutExpired):
            return
        for block in re.split(r"\n(?=\S)", out):
            words = block.split("\n", 1)[0].split()
            if len(words) < 2 or ":" not in words[-1]:
                continue
            peer = words[-1].rsplit(":", 1)[0].strip("[]")
            if peer in skip or peer.startswith("127.") or peer == "::1":
                continue
            for key, pattern in (("tb_max", r"\btb(\d+)"), ("rb_max", r"\brb(\d+)"), ("cwnd_max", r"\bcwnd:(\d+)")):
                m = re.search(pattern, block)
                if m:
                    found[key] = max(found.get(key, 0), int(m.group(1)))
            m = re.search(r"\brtt:([\d.]+)/", block)
            if m:
                found["rtt_ms_max"] = max(found.get("rtt_ms_max", 0.0), float(m.group(1)))


def _sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return None


def _send_recv(link: object, payload: object, split: bool) -> float:
    """The same bytes as the all-gather, each lane's share sent to the other island and received
    into buffers touched beforehand (no copies, no page faults). ``split=False``: on the lanes
    themselves, so each lane's TCP connection carries both directions at once, as the all-gather
    does; ``split=True``: on two extra gloo groups per lane, one per direction, so each connection
    carries one. Two islands; seconds on the slower."""
    import torch
    import torch.distributed as dist

    n_lanes, peer, tag = len(link.lanes.groups), 1 - link.island, "split" if split else "duplex"
    size = (payload.numel() + n_lanes - 1) // n_lanes
    parts = [payload[k * size : (k + 1) * size] for k in range(n_lanes)]
    bufs = [torch.zeros(part.numel(), dtype=torch.uint8) for part in parts]
    if split:  # group 2k carries island 0 -> 1, group 2k + 1 island 1 -> 0
        groups = [dist.ProcessGroupGloo(dist.PrefixStore(f"{link.run_id}/split{g}/", link.store), link.island, 2,
                                        link.lanes._options()) for g in range(2 * n_lanes)]
        send = [groups[2 * k + link.island] for k in range(n_lanes)]
        recv = [groups[2 * k + peer] for k in range(n_lanes)]
    else:
        send = recv = link.lanes.groups
    link.gather_objects(f"go-{tag}", True)
    t0 = time.perf_counter()
    works = [w for k in range(n_lanes) for w in (send[k].send([parts[k]], peer, 0), recv[k].recv([bufs[k]], peer, 0))]
    for w in works:
        w.wait()
    return max(link.gather_objects(f"seconds-{tag}", time.perf_counter() - t0))


SYSCTLS = ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem", "net.ipv4.tcp_congestion_control",
           "net.ipv4.tcp_slow_start_after_idle")
ROUND_GAP_S = 1.0  # between the two timed all-gathers: longer than TCP's idle restart (one RTO, >= 200 ms)


def _timed_all_gather(link: object, payload: object, crcs: list[int], coordinator: str | None) -> dict:
    """One all-gather of ``payload``: this island's seconds, whether every island's bytes arrived
    intact, and its lanes' socket samples."""
    sampled: dict = {}
    stop = threading.Event()
    skip = {coordinator.rsplit(":", 1)[0]} if coordinator else set()
    sampler = threading.Thread(target=_sample_sockets, args=(skip, stop, sampled), daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    got = link.all_gather_bytes(payload)
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join(timeout=5)
    ok = all(zlib.crc32(g.numpy()) == c for g, c in zip(got, crcs))
    del got
    return {"seconds": seconds, "intact": ok, **sampled}


def worker(args: argparse.Namespace) -> None:
    """One island's leader: for each TCP setting and lane count, two timed all-gathers a round's
    gap apart (a first round on new connections, then the next round)."""
    import torch

    from lightning_islands.app.netns import TUNED_TCP, write_sysctls
    from lightning_islands.link.coordinator import island_identity
    from lightning_islands.link.island_link import IslandLink

    island, num_islands, coordinator, run_id = island_identity()
    n = int(args.payload_mb * 1e6)
    payload = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(island))
    crc = zlib.crc32(payload.numpy())
    rows, info = [], {}
    for tcp in args.tcp:
        if tcp == "tuned":
            if not os.environ.get("LI_LINK_IFNAME"):  # only ever inside the link's own namespace
                raise SystemExit("--tcp tuned sets sysctls: it runs only inside a shaped link's namespaces")
            write_sysctls(TUNED_TCP)  # this namespace's own (what `--link RATE,RTT,tuned` sets)
        info[tcp] = {name: _sysctl(name) for name in SYSCTLS}
        for lanes in args.lanes:
            link = IslandLink(coordinator, island, num_islands, run_id=f"{run_id}-{tcp}-l{lanes}", lanes=lanes,
                              deadline=timedelta(seconds=args.timeout))
            crcs = link.gather_objects("crc", crc)
            start = time.perf_counter()
            link.open_lanes()
            link.all_gather_bytes(torch.zeros(64 * 1024, dtype=torch.uint8))  # every lane's connection is up
            open_s = max(link.gather_objects("open", time.perf_counter() - start))
            rounds = []
            for r in range(2):
                if r:
                    time.sleep(args.round_gap)  # idle, as a run is between two rounds
                link.gather_objects(f"go{r}", True)
                rounds.append(_timed_all_gather(link, payload, crcs, coordinator))
                rounds[-1]["seconds"] = max(link.gather_objects(f"seconds{r}", rounds[-1]["seconds"]))
            first, nxt = rounds
            row = {"tcp": tcp, "lanes": lanes, "payload_bytes": n, "open_seconds": open_s,
                   "first_seconds": first["seconds"], **nxt, "intact": first["intact"] and nxt["intact"]}
            if num_islands == 2 and tcp == args.tcp[0]:
                row["duplex_seconds"] = _send_recv(link, payload, split=False)
                row["split_seconds"] = _send_recv(link, payload, split=True)
            rows.append(row)
            link.close()
    record = {"island": island, "rows": rows, "sysctl": info}
    Path(args.result_dir, f"island{island}.json").write_text(json.dumps(record))


# ------------------------------------------------------------------------------------------ latency
class _DelayProxy:
    """A TCP proxy on 127.0.0.1 that holds every chunk ``delay`` seconds each way: the coordinator
    ``2 * delay`` away. It ends each TCP connection, so it counts request-response round trips of
    small messages faithfully, not the window dynamics of bulk transfers."""

    def __init__(self, target_port: int, delay: float) -> None:
        self.delay, self.target = delay, target_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((client, upstream), (upstream, client)):
                a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        queue: list[tuple[float, bytes]] = []
        cond = threading.Condition()

        def send() -> None:
            while True:
                with cond:
                    while not queue:
                        cond.wait()
                    due, data = queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                    continue
                with cond:
                    queue.pop(0)
                try:
                    if not data:
                        dst.shutdown(socket.SHUT_WR)
                        return
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=send, daemon=True).start()
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            with cond:
                queue.append((time.monotonic() + self.delay, data))
                cond.notify()
            if not data:
                return

    def close(self) -> None:
        self.server.close()


class _CountingStore:
    """Forwards to a c10d store and counts each kind of call."""

    def __init__(self, store: object, counts: dict[str, int]) -> None:
        self._store, self._counts = store, counts

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._store, name)
        if name in RTT_OPS and callable(attr):
            def counted(*a: object, **k: object) -> object:
                self._counts[name] = self._counts.get(name, 0) + 1
                return attr(*a, **k)
            return counted
        return attr


def _membership_round_trips(stores: list, per_op: dict, rtt: float, rounds: int = 3) -> dict:
    """The store requests of a round's membership (``decide``, then ``settle``) of one island per
    client in ``stores`` when they arrive together, timed and counted; ``rounds`` rounds, the last
    one's counts kept."""
    from lightning_islands.link.membership import Membership

    islands = len(stores)
    counts: list[dict[str, int]] = [{} for _ in stores]
    members = [Membership(_CountingStore(store, counts[i]), "rtm", i, islands, 1, 10.0, None, lambda j: None)
               for i, store in enumerate(stores)]
    timed = [[0.0, 0.0] for _ in stores]
    barrier = threading.Barrier(islands)

    def run(i: int) -> None:
        for r in range(rounds):
            barrier.wait()
            counts[i].clear()
            t0 = time.perf_counter()
            decision, _ = members[i].decide(r, {"tokens": 1})
            t1 = time.perf_counter()
            members[i].settle(decision)
            timed[i] = [round((t1 - t0) / rtt, 1), round((time.perf_counter() - t1) / rtt, 1)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(islands)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"ops": counts, "round_trips_decide_settle": timed,
            "round_trips_counted": [sum(round(per_op.get(k, 0)) * v for k, v in c.items()) for c in counts]}


def store_round_trips(rtt: float = 0.04, islands: int = 2) -> dict:
    """Measured: round trips each store op costs, and the ops and time of one header gather between
    ``islands`` islands (threads here) when every island arrives at once, over a coordinator ``rtt``
    away."""
    import torch.distributed as dist

    from lightning_islands.link.coordinator import Coordinator, status_key
    from lightning_islands.link.island_link import IslandLink

    coordinator = Coordinator("127.0.0.1", 0)
    proxy = _DelayProxy(coordinator.port, rtt / 2)
    address = f"127.0.0.1:{proxy.port}"
    client = dist.TCPStore("127.0.0.1", proxy.port, is_master=False, timeout=timedelta(seconds=30))
    client.set("k", "v")
    per_op = {}
    for name, op in (("set", lambda: client.set("k", "v")), ("check", lambda: client.check(["k"])),
                     ("get", lambda: client.get("k")), ("add", lambda: client.add("n", 1)),
                     ("compare_set", lambda: client.compare_set("k", "v", "v")),
                     ("multi_get", lambda: client.multi_get(["k", "k"]))):
        t0 = time.perf_counter()
        for _ in range(5):
            op()
        per_op[name] = round((time.perf_counter() - t0) / 5 / rtt, 2)
    links = [IslandLink(address, i, islands, run_id="rt", lanes=1, deadline=timedelta(seconds=30))
             for i in range(islands)]
    counts: list[dict[str, int]] = [{} for _ in links]
    stores = [link.store for link in links]
    for link, c in zip(links, counts):
        # no secret: the link's values go through one plain client (status lines: the link's own thread)
        link.store = link._plain = _CountingStore(link.store, c)  # type: ignore[assignment]
    seconds = [0.0] * islands
    barrier = threading.Barrier(islands)

    for link in links:  # as in training, where every island beats with every step
        link.heartbeat({"step": 1})
    # a set awaits no reply: wait until every beat has landed, or an island that looks before its peer's
    # beat arrives counts a check without a get (9 round trips instead of 11, by the scheduler's whim)
    beat_keys = [status_key("rt", i) for i in range(islands)]
    while not client.check(beat_keys):
        time.sleep(0.005)

    def header(i: int) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        links[i].gather_objects("round0", {"tokens": 1, "experts": None})
        seconds[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=header, args=(i,)) for i in range(islands)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    membership = _membership_round_trips(stores, per_op, rtt)
    proxy.close()
    return {"rtt_s": rtt, "round_trips_per_op": per_op, "header_gather_ops": counts, "round": membership,
            "header_gather_round_trips": [round(s / rtt, 1) for s in seconds],
            # each op costs a whole number of round trips; its timing above also holds the host's overhead
            "header_gather_round_trips_counted": [sum(round(per_op.get(k, 0)) * v for k, v in c.items())
                                                  for c in counts]}


# ------------------------------------------------------------------------------------------ driver
def window_table(rate_bps: float, rtt_s: float, lanes: list[int], wmem_max: int | None) -> list[dict]:
    """Per lane count: the window each lane needs (BDP / lanes), and the rate a lane's send buffer
    cap allows at that RTT."""
    rows = []
    for k in lanes:
        need = rate_bps * rtt_s / 8 / k
        cap = (wmem_max * 8 / rtt_s * k / rate_bps) if wmem_max and rtt_s else None
        rows.append({"lanes": k, "window_bytes_per_lane": int(need), "wmem_max_share_of_rate": cap})
    return rows


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for lanes.json and the islands' logs")
    parser.add_argument("--quick", action="store_true", help="lanes 1,2, 8 MB, 200mbit: a smoke test")
    parser.add_argument("--rate", default=None, help="shaped rate (default 1gbit; --quick: 200mbit)")
    parser.add_argument("--rtt", default="100ms", help="RTT between islands (default 100ms)")
    parser.add_argument("--payload-mb", type=float, default=None, help="payload per island (default 300; --quick: 8)")
    parser.add_argument("--lanes", default=None, help="lane counts (default 1,2,4,8; --quick: 1,2)")
    parser.add_argument("--tcp", default=None,
                        help="host TCP settings to run, of default,tuned (default both; --quick: default)")
    parser.add_argument("--timeout", type=float, default=300.0, help="the links' deadline_s (a transfer's bound)")
    parser.add_argument("--round-gap", type=float, default=ROUND_GAP_S,
                        help=f"seconds between the two timed all-gathers (default {ROUND_GAP_S:g}; keep it above "
                             "TCP's idle restart, one RTO: >= 0.2 s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.lanes = [int(x) for x in (args.lanes or ("1,2" if args.quick else "1,2,4,8")).split(",")]
    args.payload_mb = args.payload_mb or (8.0 if args.quick else 300.0)
    args.tcp = (args.tcp or ("default" if args.quick else "default,tuned")).split(",")
    if not args.tcp or any(t not in ("default", "tuned") for t in args.tcp):
        parser.error(f"--tcp takes default, tuned or both, not {','.join(args.tcp)}")
    if args.worker:
        worker(args)
        return 0
    if not args.out:
        parser.error("--out DIR is required")

    from lightning_islands.app.launch import run_islands
    from lightning_islands.app.netns import TUNED_TCP, LinkUnavailable, check_link_support, format_rate, parse_link

    try:
        check_link_support()
    except LinkUnavailable as err:
        print(f"benchmarks/lanes.py: {err}", file=sys.stderr)
        return 2
    spec = parse_link(f"{args.rate or ('200mbit' if args.quick else '1gbit')},{args.rtt}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--payload-mb", str(args.payload_mb),
               "--lanes", ",".join(map(str, args.lanes)), "--tcp", ",".join(args.tcp), "--timeout", str(args.timeout),
               "--round-gap", str(args.round_gap), "--result-dir", str(out)]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    results = run_islands([1, 1], command, log_dir=out / "logs", env=env, live=False, link=spec)
    if any(r.returncode for r in results):
        for r in results:
            print(f"island {r.island} exit {r.returncode}:\n  " + "\n  ".join(r.log_tail[-20:]), file=sys.stderr)
        return 1
    link = json.loads((out / "logs" / "link.json").read_text())
    islands = [json.loads((out / f"island{i}.json").read_text()) for i in range(2)]
    rtt_ms = link["rtt_s"] * 1e3
    rows = []
    for r0, r1 in zip(islands[0]["rows"], islands[1]["rows"]):
        achieved = r0["payload_bytes"] * 8 / r0["seconds"]
        rows.append({"tcp": r0["tcp"], "lanes": r0["lanes"], "payload_bytes": r0["payload_bytes"],
                     "open_seconds": round(r0["open_seconds"], 3),
                     "seconds": round(r0["seconds"], 3), "first_seconds": round(r0["first_seconds"], 3),
                     "achieved_bps": round(achieved), "shaped_bps": spec.rate_bps,
                     "ratio": round(achieved / spec.rate_bps, 3),
                     "first_ratio": round(r0["payload_bytes"] * 8 / r0["first_seconds"] / spec.rate_bps, 3),
                     "rtt_ms": rtt_ms,
                     "intact": r0["intact"] and r1["intact"],
                     **{f"{kind}_ratio": (round(r0["payload_bytes"] * 8 / r0[f"{kind}_seconds"] / spec.rate_bps, 3)
                                         if f"{kind}_seconds" in r0 else None) for kind in ("duplex", "split")},
                     "lane_sndbuf_max": max(r0.get("tb_max", 0), r1.get("tb_max", 0)),
                     "lane_cwnd_max": max(r0.get("cwnd_max", 0), r1.get("cwnd_max", 0)),
                     "lane_rtt_ms_max": max(r0.get("rtt_ms_max", 0.0), r1.get("rtt_ms_max", 0.0))})
    sysctl = islands[0]["sysctl"]
    wmem = sysctl.get(args.tcp[0], {}).get("net.ipv4.tcp_wmem")
    wmem_max = int(wmem.split()[-1]) if wmem else None
    latency = store_round_trips()
    windows = window_table(spec.rate_bps, spec.rtt_s or 0.1, args.lanes, wmem_max)
    print(f"link: {link['describe']}")
    print(f"island TCP: {sysctl}")
    print("\n| host TCP | lanes | open (s) | payload MB | seconds | achieved Mbit/s | shaped Mbit/s | ratio "
          "| first round | RTT ms | intact | duplex send/recv | split send/recv |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        refs = " | ".join(f"{r[k]:.3f}" if r[k] is not None else "-" for k in ("duplex_ratio", "split_ratio"))
        print(f"| {r['tcp']} | {r['lanes']} | {r['open_seconds']:.2f} | {r['payload_bytes'] / 1e6:g} | "
              f"{r['seconds']:.2f} | "
              f"{r['achieved_bps'] / 1e6:.0f} | {r['shaped_bps'] / 1e6:g} | {r['ratio']:.3f} | "
              f"{r['first_ratio']:.3f} | {r['rtt_ms']:g} | {r['intact']} | {refs} |")
    print("(open: building the lanes and a first 64 kB all-gather on them, the slower island. "
          "ratio: IslandLink.all_gather_bytes of the next round, a round's gap after the first, achieved / shaped "
          "rate; first round: on new connections. host TCP: the island namespaces' sysctls as a new namespace has "
          f"them, or tuned: {TUNED_TCP}. The same bytes with gloo send/recv into touched buffers: duplex, on the lanes "
          "(each TCP connection carries both directions, as in the all-gather); split, one gloo group per lane and "
          "direction (each connection carries one).)")
    rtt_target = spec.rtt_s or 0.1
    print(f"\nper-round cost of latency (measured through a proxy with the coordinator {latency['rtt_s'] * 1e3:g} ms "
          f"away): round trips per store op {latency['round_trips_per_op']}; one header gather between 2 islands "
          f"arriving together: ops {latency['header_gather_ops']}, {latency['header_gather_round_trips']} round trips "
          f"(timed), {latency['header_gather_round_trips_counted']} (counted); a round's membership (decide, "
          f"settle): ops {latency['round']['ops']}, {latency['round']['round_trips_decide_settle']} round trips "
          f"(timed), {latency['round']['round_trips_counted']} (counted)")
    print(f"window each lane needs at {format_rate(spec.rate_bps)} and {rtt_target * 1e3:g} ms (BDP / lanes), "
          f"and the share of the rate a {wmem_max} B send buffer cap allows:")
    for w in windows:
        cap = w["wmem_max_share_of_rate"]
        print(f"  {w['lanes']} lanes: {w['window_bytes_per_lane'] / 1e6:.2f} MB per lane"
              + (f", cap {min(cap, 1.0):.2f}" if cap is not None else ""))
    if spec.rtt_s and not link["rtt_s"]:
        print(f"no delay: the link could not add the {spec.rtt_s * 1e3:g} ms RTT, so the table is rate-only")
    (out / "lanes.json").write_text(json.dumps({
        "rows": rows, "link": link, "sysctl": sysctl, "latency": latency, "windows": windows,
        "command": " ".join(["python", "benchmarks/lanes.py", *(argv if argv is not None else sys.argv[1:])]),
        "commit": _commit()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
