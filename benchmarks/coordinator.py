"""What a round's membership costs on each coordinator, and the stall when etcd's leader dies.

Two islands (threads of this process, real :class:`~lightning_islands.link.island_link.IslandLink`s
and gloo lanes over loopback) run ``--rounds`` rounds of membership alone (``meet_round`` then
``settle_round``, no payload), first on a TCPStore coordinator, then on a local etcd cluster of
``--members`` members (:class:`~lightning_islands.app.etcd_cluster.LocalEtcdCluster`). Each store
request of the membership protocol is counted (one round trip to the coordinator each; a wait's
pause is a sleep on the TCPStore and a watch on etcd, not counted: it ends with the event).

Columns: ``requests/round``: the requests one island's membership made per round, median over
islands; ``s/round``: the median wall time of a round on loopback; ``at 100 ms``: computed, not
emulated: the requests times 100 ms between the islands and the coordinator and, for etcd with its
members 100 ms apart, one more round trip between members per request (a write commits on a
majority; a linearizable read confirms the leader with a majority). The emulator can delay the
islands' traffic to a coordinator but not traffic between etcd members.

The last table: with etcd, the leader member SIGKILLed after ``--rounds // 2`` rounds (the
supervisor restarts it): the longest round against the median, i.e. the survivors' stall.

    PYTHONPATH=. python benchmarks/coordinator.py [--rounds 20] [--members 3] --out DIR

writes ``DIR/coordinator.json`` and prints the tables in markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from lightning_islands.app.etcd_cluster import LocalEtcdCluster
from lightning_islands.link.coordinator import Coordinator
from lightning_islands.link.island_link import IslandLink

RTT_S = 0.1


class Counting:
    """A store client that counts the requests each operation makes."""

    def __init__(self, store: Any) -> None:
        self.store, self.count = store, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def counted(*a: Any, **k: Any) -> Any:
            self.count += 1
            return attr(*a, **k)
        return counted


def rounds(address: str, run_id: str, n: int, kill: Any = None) -> dict[str, Any]:
    """``n`` membership rounds of two islands at ``address``; ``kill()`` runs after ``n // 2``."""
    links = [IslandLink(address, i, 2, run_id=run_id, lanes=1, grace_s=10.0) for i in range(2)]
    for link in links:
        link.membership.store = Counting(link.membership.store)
    opened = [threading.Thread(target=link.open_lanes) for link in links]
    for t in opened:
        t.start()
    for t in opened:
        t.join()
    seconds: list[float] = []
    barrier = threading.Barrier(2)

    def island(link: IslandLink) -> None:
        for r in range(n):
            barrier.wait()
            if link.island == 0 and kill is not None and r == n // 2:
                kill()
            started = time.monotonic()
            link.meet_round(r, {"round": r})
            link.settle_round()
            if link.island == 0:
                seconds.append(time.monotonic() - started)
    threads = [threading.Thread(target=island, args=(link,)) for link in links]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    requests = statistics.median(link.membership.store.count / n for link in links)
    for link in links:
        link.close()
    return {"requests_per_round": requests, "s_per_round": statistics.median(seconds),
            "longest_s": max(seconds), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="directory for coordinator.json")
    args = parser.parse_args()
    coordinator = Coordinator()
    tcp = rounds(coordinator.address, "bench-tcp", args.rounds)
    with LocalEtcdCluster(args.members) as cluster:
        etcd = rounds(cluster.address, "bench-etcd", args.rounds)
        killed: list[str] = []

        def kill() -> None:
            leader = cluster.leader()
            if leader is not None:
                process = leader.process
                cluster.kill(leader)
                process.wait()
                killed.append(leader.name)
        stall = rounds(cluster.address, "bench-kill", args.rounds, kill)
    rows = [("TCPStore", tcp, 0), (f"etcd, {args.members} members", etcd, 1)]
    print("| coordinator | requests/round | s/round (loopback) | at 100 ms |")
    print("|---|---:|---:|---:|")
    for name, r, extra in rows:
        at = r["requests_per_round"] * RTT_S * (1 + extra)
        print(f"| {name} | {r['requests_per_round']:.1f} | {r['s_per_round']:.4f} | {at:.1f} s |")
    print()
    print("| etcd leader killed | median round | longest round | stall |")
    print("|---|---:|---:|---:|")
    median = statistics.median(stall["seconds"])
    print(f"| member {killed[0] if killed else '?'} at round {args.rounds // 2} | {median:.3f} s | "
          f"{stall['longest_s']:.3f} s | {stall['longest_s'] - median:.2f} s |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "coordinator.json").write_text(json.dumps(
            {"rounds": args.rounds, "members": args.members, "tcp": tcp, "etcd": etcd, "leader_killed": stall,
             "killed": killed}, indent=2))


if __name__ == "__main__":
    main()
