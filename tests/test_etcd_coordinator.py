"""The coordinator on a real etcd cluster (``LI_COORDINATOR=etcd://...``).

The store's primitives against one real etcd member (a decision succeeds once, waits are watches,
a lease takes only its own keys, gloo rendezvous over it); islands as threads of this test with
real :class:`~lightning_islands.link.island_link.IslandLink`s and gloo lanes on a three-member
cluster whose leader is SIGKILLed or partitioned away mid-run; real processes launched with
``run --coordinator``: a leader killed in inner steps, an island's lease expiring while its process
is stopped, the majority lost (every island ends naming the cluster and the fix) and the run
resumed from its checkpoints once the cluster is back.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import kill_island_process, load_rounds
from doubles import run_threads
from test_engine import SPECS, initial_flat
from test_membership import _train

from lightning_islands.app.etcd_cluster import LocalEtcdCluster
from lightning_islands.engine import CanonicalLayout, IslandEngine, IslandSettings
from lightning_islands.link.etcd_credentials import EtcdCredentials
from lightning_islands.link.etcd_store import ROOT, EtcdAccessDenied, EtcdStore, EtcdUnreachable
from lightning_islands.link.island_link import IslandLink


@pytest.fixture(scope="module")
def one_member(tmp_path_factory):
    with LocalEtcdCluster(1, data_dir=tmp_path_factory.mktemp("etcd1")) as cluster:
        yield cluster


# longer than the cluster takes to elect a new leader (about a second here): a leader's loss is
# then invisible to the islands, as with the default grace_s of 60 s
GRACE = 5.0


def _link(address: str, i: int, n: int, run_id: str, **kw) -> IslandLink:
    return IslandLink(address, i, n, run_id=run_id, lanes=2, grace_s=kw.pop("grace_s", GRACE), **kw)


def _engine(i: int, n: int, link: IslandLink, grace_s: float = GRACE) -> tuple[IslandEngine, list[torch.Tensor]]:
    settings = IslandSettings(sync_every=3, outer_lr=0.7, outer_momentum=0.9, grace_s=grace_s)
    layout = CanonicalLayout(SPECS)
    engine = IslandEngine(settings, layout, i, n, torch.device("cpu"), torch.device("cpu"))
    return engine, [layout.shard_of(initial_flat(i), k).clone() for k in range(len(SPECS))]


def test_a_decision_succeeds_once_and_a_get_waits_on_a_watch(one_member):
    a, b = EtcdStore(one_member.address), EtcdStore(one_member.address)
    assert a.compare_set("once/decision", "", "round 3: [0, 1]") == b"round 3: [0, 1]"
    assert b.compare_set("once/decision", "", "round 3: [1]") == b"round 3: [0, 1]", "the second proposal loses"
    assert a.compare_set("once/decision", "round 3: [0, 1]", "round 3: [0]") == b"round 3: [0]"
    assert [a.add("once/count", 1), b.add("once/count", 2)] == [1, 3]
    assert a.check(["once/decision", "once/count"]) and not a.check(["once/decision", "once/none"])
    assert a.delete_key("once/count") and not a.delete_key("once/count")
    assert a.get_if_set("once/count") is None and a.get_if_set("once/decision") == b"round 3: [0]", "no waiting"
    threading.Timer(0.3, lambda: b.set("once/late", "v")).start()
    assert a.get("once/late") == b"v", "get waits (a watch) for a key set later"
    with pytest.raises(dist.DistStoreError, match="timed out after 1 s waiting for keys"):
        a.wait(["once/never"], timedelta(seconds=1))


def test_a_lease_takes_only_its_own_keys_when_its_holder_stops_renewing_it(one_member):
    ttl = [30.0]
    plain, beat = EtcdStore(one_member.address), EtcdStore(one_member.address, lease_ttl=lambda: ttl[0])
    beat.set("lease/alive/0", "0:0")
    ttl[0] = 4.5  # grace_s changed: the next write takes a new lease of the new length (whole seconds: 5)
    plain.set("lease/decision", "kept")
    beat.set("lease/alive/0", "0:1")
    renewed, count = time.monotonic(), 1
    # renewed by each write (progress) for longer than its TTL: kept. Writes a quarter second apart:
    # only a machine stalled for the whole 5 s between two of them could let it lapse
    while time.monotonic() - renewed < 6.0:
        time.sleep(0.25)
        count += 1
        beat.set("lease/alive/0", f"0:{count}")
        assert plain.check(["lease/alive/0"])
    deadline = time.monotonic() + 30
    while plain.check(["lease/alive/0"]):  # no more progress: gone after the TTL
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.1)
    assert plain.get("lease/decision") == b"kept", "a key without the lease stays"
    with pytest.raises(RuntimeError, match="expired"):
        beat.set("lease/alive/0", "0:9")  # the holder learns it; the link's beat reconnects with a new lease


def test_gloo_groups_rendezvous_through_the_cluster(one_member):
    stores = [EtcdStore(one_member.address) for _ in range(2)]  # kept alive while their groups are

    def rank(r: int) -> torch.Tensor:
        group = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", stores[r]), r, 2, timedelta(seconds=30))
        t = torch.full((4,), float(r + 1))
        group.allreduce([t]).wait()
        return t
    assert all(torch.equal(t, torch.full((4,), 3.0)) for t in run_threads([lambda: rank(0), lambda: rank(1)]))


def test_an_unreachable_cluster_is_named_with_the_fix():
    from lightning_islands.app.launch import free_port

    store = EtcdStore(f"etcd://127.0.0.1:{free_port()}", timedelta(seconds=1))
    with pytest.raises(EtcdUnreachable, match=r"did not answer for 1 s.*majority of its members must be up.*"
                                              r"restart the members"):
        store.set("k", "v")


def _leader(cluster: LocalEtcdCluster):
    deadline = time.monotonic() + 60
    while (leader := cluster.leader()) is None:
        assert time.monotonic() < deadline, "the cluster elected no leader"
        time.sleep(0.05)
    return leader


def _kill_leader(cluster: LocalEtcdCluster, killed: list) -> None:
    """SIGKILL the member that leads now; the fault happened when its process is gone."""
    leader = _leader(cluster)
    process = leader.process
    cluster.kill(leader)
    process.wait(timeout=30)
    killed.append((leader.name, process.returncode))


def _train_two_islands_faulting_round_3(address: str, run_id: str, fault, **link_kw) -> dict[int, dict]:
    """Islands 0 and 1 as threads train 6 rounds; ``fault()`` runs once, just before island 0
    proposes round 3's member set. Returns each island's global state by round."""
    results: dict[int, dict[int, torch.Tensor]] = {0: {}, 1: {}}
    done: list[bool] = []

    def island(i: int) -> None:
        link = _link(address, i, 2, run_id, **link_kw)
        if i == 0:
            propose = link.membership._propose

            def propose_after_the_fault(round_, *args, **kw):
                if round_ == 3 and not done:
                    fault()  # the decision's transaction goes to the cluster after it
                    done.append(True)
                return propose(round_, *args, **kw)
            link.membership._propose = propose_after_the_fault
        engine, locals_ = _engine(i, 2, link)
        engine.meet(lambda: link, engine.fingerprint(False))
        engine.adopt_initial_state(locals_, {})
        _train(engine, locals_, i, 6, results[i], pause=0.02)
        link.close()

    run_threads([lambda: island(0), lambda: island(1)])
    return results


def test_two_islands_train_on_while_the_leader_member_is_killed_in_a_decision(tmp_path):
    """The leader member SIGKILLed while island 0 proposes round 3's member set (the multi-process
    test below kills it in inner steps): every round counts, the global states stay bit-identical,
    and the member is restarted and rejoins the cluster."""
    with LocalEtcdCluster(3, data_dir=tmp_path) as cluster:
        killed: list = []
        results = _train_two_islands_faulting_round_3(cluster.address, "leader", lambda: _kill_leader(cluster, killed))
        assert len(killed) == 1 and killed[0][1] == -9, killed
        deadline = time.monotonic() + 60
        while sum(m.restarts for m in cluster.members) < 1:
            assert time.monotonic() < deadline, "the supervisor did not restart the killed members"
            time.sleep(0.05)
        cluster.wait_healthy(60)
    assert sorted(results[0]) == list(range(1, 7)) == sorted(results[1]), "no round was lost"
    for r in results[0]:
        assert torch.equal(results[0][r], results[1][r]), f"round {r}: global states differ"


def _link_state(namespace: str, device: str) -> str:
    shown = subprocess.run(["ip", "netns", "exec", namespace, "ip", "-o", "link", "show", device],
                           capture_output=True, text=True, check=True).stdout
    return "DOWN" if "state DOWN" in shown or "<BROADCAST,MULTICAST>" in shown else "UP"


def test_two_islands_train_on_while_the_leader_member_is_partitioned_away(tmp_path):
    """Each member in a network namespace of its own (the islands in the hub's, behind a bridge);
    the leader member's veth taken down while island 0 proposes round 3's member set: its process
    lives on, cut off, nothing reset. The other two elect a leader, the islands' requests to the
    cut-off member time out and go to them, every round counts bit-identically; with the link back
    the member, never restarted, catches up and holds the run's latest decision."""
    from lightning_islands.app.netns import entered, shaped_link

    with shaped_link("10gbit", 3) as net, entered(net.hub_namespace):
        ports = net.islands
        cluster = LocalEtcdCluster(3, data_dir=tmp_path, hosts=[p.address for p in ports],
                                   prefixes=[net.exec_prefix(i) for i in range(3)])
        with cluster:
            cut: list = []

            def cut_the_leader() -> None:
                leader = _leader(cluster)
                port = ports[cluster.members.index(leader)]
                subprocess.run(["ip", "netns", "exec", port.namespace, "ip", "link", "set", port.interface, "down"],
                               check=True)
                cut.append((leader, port, _link_state(port.namespace, port.interface)))

            results = _train_two_islands_faulting_round_3(cluster.address, "partition", cut_the_leader,
                                                          interface="li-br")
            assert len(cut) == 1 and cut[0][2] == "DOWN", cut
            member, port, _ = cut[0]
            assert member.process.poll() is None and member.restarts == 0, "cut off, not killed"
            assert not cluster.healthy(member), "while cut off it answers nobody"
            subprocess.run(["ip", "netns", "exec", port.namespace, "ip", "link", "set", port.interface, "up"],
                           check=True)
            cluster.wait_healthy(60)
            key, other = f"{ROOT}partition/round5/a0/members", next(m for m in cluster.members if m is not member)
            latest = cluster.get(key, member=other)
            deadline = time.monotonic() + 60
            while cluster.get(key, member=member) != latest:
                assert time.monotonic() < deadline, "the member never caught up"
                time.sleep(0.05)
            assert latest is not None and member.restarts == 0
    assert sorted(results[0]) == list(range(1, 7)) == sorted(results[1]), "no round was lost"
    for r in results[0]:
        assert torch.equal(results[0][r], results[1][r]), f"round {r}: global states differ"


def test_run_with_an_etcd_coordinator_trains_processes_bit_identically_through_a_leader_kill(tmp_path):
    """``lightning-islands run --coordinator etcd://...``: two islands of real processes (the real
    Trainer, gloo) meet on a three-member cluster; its leader SIGKILLed once round 2 landed, the
    run ends with every round, bit-identical."""
    from conftest import SCRIPTS
    from test_islands import assert_islands_equal

    out = tmp_path / "out"
    with LocalEtcdCluster(3, data_dir=tmp_path / "etcd") as cluster:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_islands.app.cli", "run", "--islands", "1,1", "--live", "off",
             "--coordinator", cluster.address, "--log-dir", str(tmp_path / "logs"), "--",
             sys.executable, str(SCRIPTS / "islands_regression.py"), "--out", str(out), "--steps", "6", "--H", "1",
             "--delays", "0.1,0.1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 300
            while not (out / "island0_round2.pt").exists():
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "round 2 never landed"
                time.sleep(0.05)
            killed: list = []
            _kill_leader(cluster, killed)
            assert not (out / "island0_round6.pt").exists(), "the leader died while rounds were still to come"
            output, _ = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, output[-4000:]
    assert killed and killed[0][1] == -9
    assert_islands_equal(out, 6)


def _run(address: str, run_id: str, tmp_path, *args: str) -> subprocess.Popen:
    from conftest import SCRIPTS

    return subprocess.Popen(
        [sys.executable, "-m", "lightning_islands.app.cli", "run", "--islands", "1,1", "--live", "off",
         "--coordinator", address, "--run-id", run_id, "--log-dir", str(tmp_path / f"logs-{run_id}"), "--",
         sys.executable, str(SCRIPTS / "islands_regression.py"), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_processes_a_stopped_islands_lease_expires_then_the_majority_is_lost_and_the_run_resumes(tmp_path):
    """``run --coordinator etcd://`` on three members, round checkpoints every round. Island 1's
    process SIGSTOPs itself after step 6 (alive, silent, its connections open): its lease is not
    renewed, so its liveness key vanishes while the process is stopped, and island 0 goes on
    without it. Two members stopped: island 0 ends (no hang) naming the cluster and the fix, its
    checkpoints whole. The members restored, a new launch resumes both islands from the last round
    both kept and trains on, bit-identical."""
    from pathlib import Path

    first, resumed = tmp_path / "first", tmp_path / "resumed"
    # deadline_s bounds how long a store request retries the cluster before an island gives up
    common = ["--steps", "400", "--H", "2", "--round-ckpt-every", "1", "--delays", "0.02", "--deadline-s", "5",
              "--grace-s", "3", "--keep-rounds", "10"]
    with LocalEtcdCluster(3, data_dir=tmp_path / "etcd") as cluster:
        plain = EtcdStore(cluster.address)
        proc = _run(cluster.address, "lost", tmp_path, "--out", str(first), *common, "--fault", "1:inner:6:STOP")
        try:
            deadline = time.monotonic() + 300
            while not (first / "pid_island1").exists():
                assert proc.poll() is None and time.monotonic() < deadline, "island 1 never stopped itself"
                time.sleep(0.05)
            pid = int((first / "pid_island1").read_text())
            while plain.check(["lost/alive/1"]):  # the lease (TTL grace_s) runs out while the process is stopped
                assert time.monotonic() < deadline, "island 1's lease never expired"
                time.sleep(0.05)
            stat = Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()
            assert stat[0] == "T", "island 1 is stopped, not gone, when its key vanished"
            while not (first / "island0_round5.pt").exists():  # island 0 trains on without it
                assert proc.poll() is None and time.monotonic() < deadline, "island 0 did not go on"
                time.sleep(0.05)
            held = cluster.members[:2]
            for member in held:
                cluster.hold(member)
            while not (first / "exit_island0_rank0").exists():  # island 0 ends, not hangs
                assert time.monotonic() < deadline, "island 0 did not end without a majority"
                time.sleep(0.05)
            kill_island_process(pid)
            text = proc.communicate(timeout=120)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode != 0, "the run went on without a majority"
        assert "stopping island 1 after step 6" in text and "members [0, 1] -> [0]" in text, text[-4000:]
        assert f"island 0 lost the coordinator, the etcd cluster at {cluster.address}" in text, text[-4000:]
        assert "Restart the members that stopped" in text, text[-4000:]
        for member in held:
            cluster.restore(member)
        cluster.wait_healthy(60)
        assert plain.check(["lost/run", "lost/fingerprint/1"]), "what the cluster held before is still there"
        again = _run(cluster.address, "lost-resumed", tmp_path, "--out", str(resumed), *common, "--max-rounds", "4",
                     "--resume", str(first / "rounds_island{island}"))
        text = again.communicate(timeout=300)[0]
        assert again.returncode == 0, text[-4000:]
    back = re.findall(r"resuming from round (\d+), the last round every island has", text)
    assert len(set(back)) == 1 and int(back[0]) == 2, text[-3000:]  # island 1 stopped in its third round
    rounds0, rounds1 = load_rounds(resumed, 0), load_rounds(resumed, 1)
    assert sorted(rounds0) == sorted(rounds1) == [3, 4], text[-3000:]
    for r in rounds0:
        assert rounds0[r]["digest"] == rounds1[r]["digest"], f"round {r}: the resumed islands differ"


def test_an_island_without_progress_loses_its_lease_and_the_round_goes_on_without_it(one_member):
    """Island 1's training thread stops after round 0 (its process and beat thread live on): its
    beat is renewed only on progress, so its lease expires, its liveness key, and only that, is
    gone from the cluster, and island 0's round 1 goes on without it."""
    links = [_link(one_member.address, i, 2, "lease", grace_s=2.0) for i in range(2)]
    run_threads([link.open_lanes for link in links])
    run_threads([lambda link=link: (link.meet_round(0, {}), link.settle_round()) for link in links])
    started = time.monotonic()
    links[0].meet_round(1, {})
    waited = time.monotonic() - started
    assert links[0].decision.present == (0,), "island 1 made no progress: round 1 goes on without it"
    plain = EtcdStore(one_member.address)
    deadline = time.monotonic() + 30  # etcd revokes an expired lease on its own schedule (every 0.5 s)
    while plain.check(["lease/alive/1"]):
        assert time.monotonic() < deadline, "island 1's lease never expired"
        time.sleep(0.05)
    assert plain.check(["lease/round0/a0/members", "lease/alive/0"]), "the decision and island 0's beat stay"
    assert links[1].alive._thread.is_alive(), "island 1's beat thread lives on"
    assert waited < 2.0 + 5.0, f"island 0 waited {waited:.1f} s"
    for link in links:
        link.close()


def test_tls_and_a_run_user_refuse_every_client_without_the_runs_credentials(tmp_path, monkeypatch):
    """Members with TLS and client certificates, a user and role per run: a client without a
    certificate, one without a user, and the user of another run are refused, each with the fix;
    islands with the run's credentials (from LI_ETCD_*) train through the cluster."""
    with LocalEtcdCluster(1, data_dir=tmp_path / "etcd", tls=True) as cluster:
        assert cluster.address and cluster.members[0].client_url.startswith("https://")
        cert_only = cluster.credentials
        run_a = cluster.add_run_user("tls-a", tmp_path / "a.password")
        run_b = cluster.add_run_user("tls-b", tmp_path / "b.password")
        assert (tmp_path / "a.password").stat().st_mode & 0o077 == 0, "the password file is the user's alone"
        no_cert = EtcdCredentials(ca_file=cert_only.ca_file)
        for creds, says in ((no_cert, "LI_ETCD_CERT"), (cert_only, "permission denied"),
                            (run_b, "permission denied")):
            with pytest.raises(EtcdAccessDenied, match=rf"refused this island \(.*{says}.*LI_ETCD_USER"):
                EtcdStore(cluster.address, timedelta(seconds=10), credentials=creds).set("tls-a/x", "v")
        with pytest.raises(EtcdAccessDenied, match="permission denied"):
            EtcdStore(cluster.address, credentials=run_a).set("tls-b/x", "v")
        for name, value in (("CA", run_a.ca_file), ("CERT", run_a.cert_file), ("KEY", run_a.key_file),
                            ("USER", run_a.user), ("PASSWORD_FILE", run_a.password_file)):
            monkeypatch.setenv(f"LI_ETCD_{name}", value)
        results: dict[int, dict[int, torch.Tensor]] = {0: {}, 1: {}}

        def island(i: int) -> None:
            # a generous grace: a TLS handshake on a loaded machine can take longer than GRACE, and
            # no island is meant to be lost here
            link = _link(cluster.address, i, 2, "tls-a", grace_s=60.0)
            engine, locals_ = _engine(i, 2, link, grace_s=60.0)
            engine.meet(lambda: link, engine.fingerprint(False))
            engine.adopt_initial_state(locals_, {})
            _train(engine, locals_, i, 3, results[i])
            link.close()
        run_threads([lambda: island(0), lambda: island(1)])
    assert sorted(results[0]) == [1, 2, 3] == sorted(results[1])
    assert all(torch.equal(results[0][r], results[1][r]) for r in results[0])
