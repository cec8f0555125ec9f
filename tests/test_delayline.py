"""The delay line (lightning_islands/app/delayline.py) on packet sockets: a SOCK_SEQPACKET pair reads
and writes whole packets as a TUN does, so the line's loop runs unchanged in-process. The line on real
TUN devices between namespaces is tested in tests/test_netns.py."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from lightning_islands.app.delayline import DelayLine


def _device() -> tuple[socket.socket, socket.socket]:
    """A packet socket pair: the user's end, and the line's non-blocking end (as a TUN's fd)."""
    user, line = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    line.setblocking(False)
    return user, line


def _serve(line: DelayLine) -> tuple[threading.Thread, int]:
    stop_r, stop_w = os.pipe()
    thread = threading.Thread(target=line.run, args=(stop_r,), daemon=True)
    thread.start()
    return thread, stop_w


def _recv_all(sock: socket.socket, n: int, timeout: float = 5.0) -> list[tuple[float, bytes]]:
    sock.settimeout(timeout)
    out = []
    for _ in range(n):
        packet = sock.recv(70_000)
        out.append((time.monotonic(), packet))
    return out


def test_every_packet_comes_back_whole_in_order_after_the_delay_on_its_own_device():
    (a_user, a_line), (b_user, b_line) = _device(), _device()
    line = DelayLine([a_line.fileno(), b_line.fileno()], delay_s=0.05, limit_bytes=10 << 20)
    thread, stop = _serve(line)
    try:
        packets = [bytes([i]) * size for i, size in enumerate([1, 65_000, 100, 1500, 64 * 1024 + 10])]
        sent = []
        for p in packets:
            sent.append(time.monotonic())
            a_user.send(p)
            b_user.send(p[::-1])
            time.sleep(0.01)
        got_a, got_b = _recv_all(a_user, len(packets)), _recv_all(b_user, len(packets))
    finally:
        os.close(stop)
        thread.join(5)
    assert [p for _, p in got_a] == packets and [p for _, p in got_b] == [p[::-1] for p in packets]
    for t_sent, (t_got, _) in zip(sent, got_a):
        assert 0.05 <= t_got - t_sent < 0.05 + 0.5, t_got - t_sent  # never early; late only by the scheduler
    assert not thread.is_alive() and line.counts() == {"passed": 10, "dropped": 0}


def test_a_busy_line_wakes_once_a_quantum_not_twice_a_packet():
    """400 packets in 0.2 s (one per 0.5 ms) through a line with a 2 ms quantum: it wakes at most
    about once per quantum while they flow, and still returns each one in order, never early."""
    user, end = _device()
    line = DelayLine([end.fileno()], delay_s=0.03, limit_bytes=10 << 20, quantum_s=0.002)
    thread, stop = _serve(line)
    got: list[tuple[float, bytes]] = []
    receiver = threading.Thread(target=lambda: got.extend(_recv_all(user, 400)))
    receiver.start()  # as it comes back: a full socket queue would drop what the line writes
    try:
        sent = []
        t0 = time.monotonic()
        for i in range(400):
            time.sleep(max(0.0, t0 + i * 5e-4 - time.monotonic()))
            sent.append(time.monotonic())
            user.send(i.to_bytes(2, "big") * 50)
        receiver.join(10)
    finally:
        os.close(stop)
        thread.join(5)
    assert [int.from_bytes(p[:2], "big") for _, p in got] == list(range(400))
    early = min(t_got - t_sent for t_sent, (t_got, _) in zip(sent, got))
    assert early >= 0.03, early
    busy = got[-1][0] - sent[0]  # from the first packet in to the last one out
    assert line.wakeups <= busy / 0.002 + 20, (line.wakeups, busy)  # without the quantum: ~800


def test_more_than_the_limit_held_is_dropped_and_the_line_goes_on():
    user, end = _device()
    line = DelayLine([end.fileno()], delay_s=0.2, limit_bytes=3000)
    thread, stop = _serve(line)
    try:
        for i in range(5):  # 5 x 1000 B within the 0.2 s: two over the limit
            user.send(bytes([i]) * 1000)
        got = [p for _, p in _recv_all(user, 3)]
        user.send(b"after")  # room again once the held ones left
        after = _recv_all(user, 1)[0][1]
    finally:
        os.close(stop)
        thread.join(5)
    assert got == [bytes([i]) * 1000 for i in range(3)] and after == b"after"
    assert line.counts() == {"passed": 4, "dropped": 2}


def test_a_delay_line_needs_a_delay_and_a_limit():
    with pytest.raises(ValueError, match="positive delay and limit"):
        DelayLine([0], delay_s=0.0, limit_bytes=1)


def test_a_device_that_goes_away_ends_its_queue_and_the_last_one_ends_the_line():
    (a_user, a_line), (b_user, b_line) = _device(), _device()
    line = DelayLine([a_line.fileno(), b_line.fileno()], delay_s=0.02, limit_bytes=1 << 20)
    thread, stop = _serve(line)
    try:
        a_user.close()  # a's device gone: b still served
        b_user.send(b"still here")
        assert _recv_all(b_user, 1)[0][1] == b"still here"
        assert thread.is_alive()
        b_user.close()
        thread.join(5)
        assert not thread.is_alive()
    finally:
        os.close(stop)
