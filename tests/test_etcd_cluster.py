"""A local etcd cluster (``lightning-islands coordinator --etcd N``): real etcd members, supervised.

A member killed mid-run is restarted and rejoins with its data; with the leader gone the others
elect one and keep every acknowledged write; the command prints the etcd:// address and stops its
members on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from lightning_islands.app.etcd_cluster import LocalEtcdCluster, etcd_binary


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_killed_leader_member_is_restarted_and_nothing_acknowledged_is_lost(tmp_path):
    with LocalEtcdCluster(3, data_dir=tmp_path) as cluster:
        assert cluster.address.startswith("etcd://") and cluster.address.count(",") == 2
        cluster.put("run/decision", "round 3: [0, 1]")
        leader = cluster.leader()
        assert leader is not None
        old_pid = leader.process.pid
        cluster.kill(leader)  # SIGKILL: the fault happened when its process is gone
        _wait(lambda: _gone(old_pid) or leader.process.pid != old_pid, "the leader member's death")
        others = [m for m in cluster.members if m is not leader]
        cluster.put("run/next", "round 4", member=others[0])  # the majority takes writes, whoever leads
        _wait(lambda: leader.restarts == 1, "the supervisor's restart")
        cluster.wait_healthy(60)
        assert leader.process.pid != old_pid
        for member in cluster.members:  # the restarted member caught up: every write, read through it too
            assert (cluster.get("run/decision", member), cluster.get("run/next", member)) == ("round 3: [0, 1]",
                                                                                               "round 4")
        pids = [m.process.pid for m in cluster.members]
    assert all(_gone(pid) for pid in pids), "stop ends every member"


def test_the_command_prints_the_address_and_stops_its_members_on_sigterm(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "lightning_islands.app.cli", "coordinator", "--etcd", "1",
                             "--data-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()  # printed once the member is healthy
        assert "etcd cluster of 1 members at etcd://127.0.0.1:" in line, line
        members = subprocess.run(["pgrep", "-f", "--", f"--data-dir {tmp_path}/m0"], capture_output=True, text=True)
        pids = [int(p) for p in members.stdout.split()]
        assert len(pids) == 1, members
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        _wait(lambda: all(_gone(p) for p in pids), "the member's exit", timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["pkill", "-9", "-f", "--", f"--data-dir {tmp_path}/m0"], check=False)


def test_a_bad_member_count_is_refused(capsys):
    from lightning_islands.app.cli import main

    with pytest.raises(SystemExit) as ended:
        main(["coordinator", "--etcd", "0"])
    assert ended.value.code == 2 and "--etcd 0: give the number of members" in capsys.readouterr().err
    assert os.access(etcd_binary(), os.X_OK)


def test_a_port_taken_before_a_member_starts_makes_the_cluster_start_on_other_ports(tmp_path):
    import socket

    cluster = LocalEtcdCluster(1, data_dir=tmp_path / "etcd")
    taken = cluster.members[0].client_port
    with socket.socket() as squatter:  # another process took the port between its pick and etcd's start
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with cluster:
            assert cluster.members[0].client_port != taken
            cluster.put("k", "v")
            assert cluster.get("k") == "v"
    assert b"address already in use" in (tmp_path / "etcd" / "m0.log").read_bytes()
