"""A delay line for the shaped link where the kernel has no ``netem``: packets, not connections.

Each island namespace gets a TUN device, and policy routing sends every packet its own processes
address to another namespace through it (``ip rule iif lo lookup`` a table whose one route is the
TUN). This process reads each packet from the TUN, holds it for the delay, and writes it back into
the same TUN, from where the kernel forwards it out of the island's veth (through its ``tbf``) as if
it had just arrived. Nothing terminates TCP: both ends' kernels see one connection with the added
round-trip time, their own windows, congestion control and loss recovery, which is what a proxy that
relays bytes cannot give.

Details that make it faithful and cheap:

- **Whole GSO packets**: the TUN is opened with ``IFF_VNET_HDR`` and TSO/checksum offloads, so TCP
  hands it packets of up to 64 KiB with a ``virtio_net_hdr`` saying how to cut them; the header goes
  back unchanged with the packet, the kernel cuts them where the wire needs it. At 1 Gbit/s that is
  about 2,000 packets a second per direction, not 83,000 frames.
- **No TCP Small Queues stall**: the socket's skb is freed when this process reads it, so a held
  packet no longer counts against its sender's TSQ budget (the reason ``netem`` sits on the hub ends).
- **A wake-up per quantum, not two per packet**: while packets flow the loop wakes at most every
  ``QUANTUM_S`` (1 ms), reads everything that arrived and writes back everything due. At 40 Mbit/s
  each way (about 4,000 packets a second, ACKs included) that cut the line's CPU from 22% to 9% of
  a core, which the islands' training shares. A packet is timed from after it was read, so it is
  never early and at most two quanta late (an RTT about 2 ms longer than asked under load).
- **FIFO per device**: every packet of a device waits the same delay, so one queue per device, in
  arrival order, is already sorted by due time; nothing is reordered.
- **Bounded**: at most ``limit_bytes`` are held per device (more are dropped, as ``netem``'s
  ``limit`` drops); the process ends when its standard input closes (its parent ended, however it
  ended) or on SIGTERM, and the devices go with their namespaces.

Run by :func:`lightning_islands.app.netns.shaped_link` as ``python -m
lightning_islands.app.delayline --delay-s D --limit-bytes N NAMESPACE:DEVICE ...``; it prints
``ready`` once every device is attached.
"""

from __future__ import annotations

import argparse
import fcntl
import math
import os
import select
import signal
import struct
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN = 0x01, 0x02, 0x04, 0x08
READ_SIZE = 65536 + 64  # the largest GSO packet plus its virtio_net_hdr
BATCH = 256  # packets read from one device per wake-up, so no device starves another
QUANTUM_S = 0.001  # the least time between two wake-ups while packets flow


def open_tun(device: str) -> int:
    """Attach to the existing TUN ``device`` of the calling thread's network namespace; returns a
    non-blocking fd that reads and writes whole (GSO) packets, each after a ``virtio_net_hdr``."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR))
        fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN)
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass
class _Queue:
    """The packets one device holds, oldest first, with the time each is due back."""

    fd: int
    packets: deque = field(default_factory=deque)
    held: int = 0
    passed: int = 0
    dropped: int = 0


class DelayLine:
    """Holds every packet read from each TUN fd for ``delay_s`` and writes it back into the same fd;
    at most ``limit_bytes`` held per fd (the rest dropped); wakes at most once per ``quantum_s``."""

    def __init__(self, fds: Sequence[int], delay_s: float, limit_bytes: int, quantum_s: float = QUANTUM_S) -> None:
        if delay_s <= 0 or limit_bytes <= 0 or quantum_s < 0:
            raise ValueError(f"a delay line needs a positive delay and limit and a quantum >= 0, not {delay_s} s, "
                             f"{limit_bytes} B and {quantum_s} s")
        self.delay_s, self.limit_bytes, self.quantum_s = delay_s, limit_bytes, quantum_s
        self.queues = {fd: _Queue(fd) for fd in fds}
        self.wakeups = 0  # times the line woke to read or write

    def _take(self, q: _Queue) -> bool:
        """Queue what ``q``'s device has ready; False when the device is gone (closed, or removed
        with its namespace). Each packet is timed from after it was read: late by the read, never
        early."""
        read, alive = [], True
        for _ in range(BATCH):
            try:
                packet = os.read(q.fd, READ_SIZE)
            except BlockingIOError:
                break
            except OSError:
                alive = False
                break
            if not packet:
                alive = False
                break
            read.append(packet)
        due = time.monotonic() + self.delay_s
        for packet in read:
            if q.held + len(packet) > self.limit_bytes:
                q.dropped += 1
                continue
            q.packets.append((due, packet))
            q.held += len(packet)
        return alive

    def _release(self, now: float) -> float | None:
        """Write back what is due; returns when the next packet is due (None: nothing held)."""
        nxt = None
        for q in self.queues.values():
            while q.packets and q.packets[0][0] <= now:
                _, packet = q.packets.popleft()
                q.held -= len(packet)
                try:
                    os.write(q.fd, packet)
                    q.passed += 1
                except OSError:  # the device is going away, or its queue is full: a lost packet
                    q.dropped += 1
            if q.packets and (nxt is None or q.packets[0][0] < nxt):
                nxt = q.packets[0][0]
        return nxt

    def run(self, stop_fd: int) -> None:
        """Serve until ``stop_fd`` becomes readable (EOF or data) or every device is gone.

        Wake-ups are at least ``quantum_s`` apart while packets flow: each one reads what arrived
        since the last and writes back what is due, so a busy link costs a wake-up per quantum, not
        two per packet (a packet is then up to two quanta late, never early)."""
        live = dict(self.queues)
        woke = -math.inf
        while live:
            now = time.monotonic()
            if now - woke < self.quantum_s:
                time.sleep(self.quantum_s - (now - woke))
            due = self._release(time.monotonic())
            timeout = None if due is None else max(0.0, due - time.monotonic())
            ready, _, _ = select.select([*live, stop_fd], [], [], timeout)
            woke = time.monotonic()
            self.wakeups += 1
            if stop_fd in ready:
                return
            for fd in ready:
                if not self._take(live[fd]):
                    del live[fd]  # what it still holds goes out, or is counted dropped, in _release

    def counts(self) -> dict[str, int]:
        """Packets passed and dropped, over every device."""
        return {"passed": sum(q.passed for q in self.queues.values()),
                "dropped": sum(q.dropped for q in self.queues.values())}


def main(argv: Sequence[str] | None = None) -> int:
    """Attach to each ``NAMESPACE:DEVICE`` and delay its packets until stdin closes or SIGTERM."""
    from lightning_islands.app.netns import entered

    parser = argparse.ArgumentParser(prog="python -m lightning_islands.app.delayline",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--delay-s", type=float, required=True, help="how long each packet is held")
    parser.add_argument("--limit-bytes", type=int, required=True, help="most bytes held per device")
    parser.add_argument("devices", nargs="+", help="NAMESPACE:DEVICE of each TUN to serve")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group: the link's owner ends it
    try:
        os.nice(-10)  # late packets are jitter; root may ask for the CPU first
    except OSError:
        pass
    fds = []
    for spec in args.devices:
        namespace, _, device = spec.rpartition(":")
        with entered(namespace):
            fds.append(open_tun(device))
    line = DelayLine(fds, args.delay_s, args.limit_bytes)
    print("ready", flush=True)
    line.run(sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
