"""The coordinator on an etcd cluster: :class:`EtcdStore`, a ``torch.distributed.Store`` over etcd.

With ``LI_COORDINATOR=etcd://h1:2379,h2:2379,h3:2379`` every key an island reads or writes (its
liveness beat, headers, each round's decision and outcome, the gloo rendezvous of its lanes) lives
in an etcd cluster, which keeps answering while a majority of its members is up. The store uses
etcd's own primitives rather than a port of the polling protocol:

- a decision (``compare_set`` with an empty expected value) is one transaction that succeeds once:
  ``create_revision == 0`` then ``put``, else read what won;
- a wait (``wait``, ``get`` of a key not there yet, :meth:`EtcdStore.await_change`) is a watch
  from the revision last read, so no change between the read and the watch is missed;
- presence is a lease: a store made with ``lease_ttl`` puts every key it writes under its lease
  and renews the lease on each write, so the key (an island's liveness beat, written only when the
  island makes progress) disappears ``lease_ttl`` seconds after the island's last progress, and
  only that key. Decisions, headers and outcomes are written by stores without a lease and stay
  (sealed with the run's MAC as on a TCPStore, :mod:`lightning_islands.link.sealed`).

It speaks etcd's v3 JSON gateway with the standard library (no gRPC build, no client package) over
one persistent HTTP connection per thread, and fails over between members: a member that does not
answer, or answers that the cluster has no leader, is left for the next one until ``timeout``
passes; then :class:`EtcdUnreachable` (a ``DistNetworkError``, which the link reports as the lost
coordinator) names the cluster and the fix. A retried ``add`` whose first reply was lost may count
twice (the gateway has no idempotency key); the link uses ``add`` only to claim an island index once.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_islands.link.etcd_credentials import (
    ENV_CA,
    ENV_CERT,
    ENV_KEY,
    ENV_PASSWORD_FILE,
    ENV_USER,
    EtcdCredentials,
)

SCHEME = "etcd://"
ROOT = "lightning_islands/"  # every key of every run lives under this prefix in the cluster
REQUEST_S = 2.0  # the longest one request to one member may take before the next member is tried
RETRY_S = 0.1  # the pause before a request goes around the members again
WATCH_S = 5.0  # the longest one watch runs before the wait reads again (through whichever member answers)


class EtcdUnreachable(dist.DistNetworkError):
    """No member of the etcd cluster answered with a leader behind it within the store's timeout."""


class _Refused(RuntimeError):
    """etcd answered and refused the request (not a member or leader problem): not retried."""


class EtcdAccessDenied(_Refused, PermissionError):
    """The cluster refused this client: no or a wrong certificate, no user, or a key outside its role."""


def is_etcd(address: str | None) -> bool:
    """Whether a coordinator address names an etcd cluster (``etcd://...``)."""
    return bool(address) and address.startswith(SCHEME)


def parse_etcd(address: str) -> list[tuple[str, int]]:
    """The members of ``etcd://host:port,host:port,...``, with an error that names the fix."""
    members = []
    for part in address[len(SCHEME):].split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"coordinator address {address!r}: member {part!r} is not HOST:PORT; write e.g. "
                             "etcd://10.0.0.1:2379,10.0.1.1:2379,10.0.2.1:2379")
        members.append((host, int(port)))
    return members


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def _after(prefix: bytes) -> bytes:
    """The end of the range of keys that start with ``prefix`` (etcd's ``range_end``)."""
    return prefix[:-1] + bytes([prefix[-1] + 1]) if prefix and prefix[-1] < 0xFF else b"\0"


def _common_prefix(keys: Sequence[bytes]) -> bytes:
    first, last = min(keys), max(keys)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n]


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` whose keys live in an etcd cluster (see the module docstring).

    Args:
        address: ``etcd://host:port,...`` (every member's client address, any order).
        timeout: how long a wait, or a request the cluster cannot answer, may take.
        lease_ttl: put every key this store writes under a lease of this many seconds (at least
            2), renewed on each write (an island's liveness beat); a function is asked at each write,
            and a new lease is granted when its answer changes (``grace_s`` grows with the rounds);
            ``None``: no lease.
        root: the prefix of every key in the cluster.
        credentials: TLS files and the run's etcd user (default: from the environment, LI_ETCD_CA and others,
            :mod:`lightning_islands.link.etcd_credentials`).
    """

    def __init__(self, address: str, timeout: timedelta = timedelta(seconds=60),
                 lease_ttl: float | Callable[[], float] | None = None,
                 root: str = ROOT, credentials: EtcdCredentials | None = None) -> None:
        super().__init__()
        self.address = address
        self.members = parse_etcd(address)
        self.credentials = EtcdCredentials.from_env() if credentials is None else credentials
        self._context = self.credentials.context()
        self._token: str | None = None
        self.set_timeout(timeout)
        self.root = root.encode()
        self.lease_ttl = lease_ttl
        self._lease: str | None = None
        self._lease_s = 0  # the TTL the current lease was granted with
        self._member = 0  # the member requests go to first (the last one that answered)
        self._local = threading.local()
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple:
        return (EtcdStore, (self.address, self.timeout, self.lease_ttl, self.root.decode(), self.credentials))

    # -- requests ----------------------------------------------------------------------------------
    def _connection(self, member: int, timeout: float) -> http.client.HTTPConnection:
        conns: dict[int, http.client.HTTPConnection] = self._local.__dict__.setdefault("conns", {})
        conn = conns.get(member)
        if conn is None:
            conn = conns[member] = self._open(member, timeout)
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def _open(self, member: int, timeout: float) -> http.client.HTTPConnection:
        host, port = self.members[member]
        if self._context is not None:
            return http.client.HTTPSConnection(host, port, timeout=timeout, context=self._context)
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def _headers(self, member: int, timeout: float) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.credentials.user is not None:
            if self._token is None:  # etcd's token for the run's user (again after it expired)
                try:
                    password = self.credentials.password()
                except ValueError as err:
                    raise EtcdAccessDenied(f"the etcd cluster at {self.address}: {err}") from err
                reply = self._once(member, "/v3/auth/authenticate", {"name": self.credentials.user,
                                                                     "password": password}, timeout,
                                   authenticate=False)
                self._token = str(reply["token"])
            headers["Authorization"] = self._token
        return headers

    def _denied(self, why: str) -> EtcdAccessDenied:
        return EtcdAccessDenied(
            f"the etcd cluster at {self.address} refused this island ({why}); give it the run's credentials: "
            f"{ENV_CA}, {ENV_CERT} and {ENV_KEY} (TLS), {ENV_USER} and {ENV_PASSWORD_FILE} (the run's user, "
            "whose role covers the run's keys); `lightning-islands coordinator --etcd N --tls --run-user RUN_ID` "
            "prints them")

    def _drop(self, member: int) -> None:
        conn = self._local.__dict__.get("conns", {}).pop(member, None)
        if conn is not None:
            conn.close()

    def _once(self, member: int, path: str, body: dict[str, Any], timeout: float,
              authenticate: bool = True) -> dict[str, Any]:
        headers = self._headers(member, timeout) if authenticate else {"Content-Type": "application/json"}
        conn = self._connection(member, timeout)
        try:
            conn.request("POST", path, json.dumps(body), headers)
            reply = conn.getresponse()
            data = reply.read()
        except ssl.SSLCertVerificationError as err:
            self._drop(member)
            raise self._denied(f"its certificate is not signed by {ENV_CA}: {err.verify_message}") from err
        except ssl.SSLError as err:
            self._drop(member)
            raise self._denied(f"TLS: {err.reason or err}") from err
        except (OSError, http.client.HTTPException):
            self._drop(member)
            raise
        answer = json.loads(data or b"{}")
        streamed = answer.get("error") if isinstance(answer.get("error"), dict) else None  # a stream's error
        if reply.status != 200 or streamed:
            status = int(streamed.get("http_code", 503)) if streamed else reply.status
            message = str(streamed.get("message") if streamed else answer.get("error") or answer.get("message")
                          or data[:200])
            # 503: no leader or the member is stopping; a member still catching up, or a request
            # that timed out inside the cluster: another member (or a later try) may answer
            if status in (429, 500, 502, 503, 504) or "leader" in message or "timed out" in message:
                raise ConnectionError(f"HTTP {status}: {message}")
            if "invalid auth token" in message:  # expired: authenticate again on the next try
                self._token = None
                raise ConnectionError(message)
            if any(word in message for word in ("permission denied", "user name is empty", "authentication failed",
                                                "CommonName")):
                raise self._denied(message)
            raise _Refused(f"etcd refused {path}: {message}")
        if "header" in answer:  # a watch starts after this thread's last read: no change in between is missed
            self._local.revision = int(answer["header"].get("revision", 0) or 0)
        return answer

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` posted to ``path`` on a member that answers, trying each in turn until the
        store's timeout passes."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        last: Exception | None = None
        while True:
            for k in range(len(self.members)):
                member = (self._member + k) % len(self.members)
                try:
                    answer = self._once(member, path, body, min(REQUEST_S, max(0.5, deadline - time.monotonic())))
                except _Refused:
                    raise
                except (OSError, http.client.HTTPException, ValueError) as err:
                    last = err
                    continue
                self._member = member
                return answer
            if time.monotonic() >= deadline:
                raise EtcdUnreachable(
                    f"the etcd cluster at {self.address} did not answer for {self.timeout.total_seconds():.0f} s "
                    f"(last: {last}); a majority of its members must be up: restart the members that stopped "
                    "(`lightning-islands coordinator --etcd N` restarts its own), then resume the run from its "
                    "checkpoints (resume=...)")
            time.sleep(RETRY_S)

    def _key(self, key: str) -> bytes:
        return self.root + key.encode()

    @staticmethod
    def _value(kv: dict[str, Any]) -> bytes:
        return base64.b64decode(kv.get("value", ""))

    # -- the Store interface -----------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        """Put ``key`` (under this store's lease, renewed first, when it has one)."""
        body: dict[str, Any] = {"key": _b64(self._key(key)), "value": _b64(value)}
        if self.lease_ttl is not None:
            body["lease"] = self._renewed_lease()
        self._call("/v3/kv/put", body)

    def _renewed_lease(self) -> str:
        asked = self.lease_ttl() if callable(self.lease_ttl) else self.lease_ttl
        ttl = max(2, math.ceil(float(asked or 0)))
        with self._lock:
            if self._lease is None or ttl != self._lease_s:  # a new TTL: a new lease, the old one expires alone
                self._lease = str(self._call("/v3/lease/grant", {"TTL": ttl})["ID"])
                self._lease_s = ttl
                return self._lease
            reply = self._call("/v3/lease/keepalive", {"ID": self._lease})
            if int(reply.get("result", {}).get("TTL", 0) or 0) <= 0:
                lease, self._lease = self._lease, None
                raise _Refused(f"lease {lease} expired: this store's keys are gone (the island was silent for "
                               f"{self._lease_s} s)")
            return self._lease

    def _range(self, key: str) -> bytes | None:
        kvs = self._call("/v3/kv/range", {"key": _b64(self._key(key))}).get("kvs") or []
        return self._value(kvs[0]) if kvs else None

    def _ranges(self, keys: Sequence[str]) -> list[bytes | None]:
        """Every key's value (``None``: absent), read in one transaction (one round trip)."""
        ops = [{"request_range": {"key": _b64(self._key(k))}} for k in keys]
        responses = self._call("/v3/kv/txn", {"success": ops}).get("responses") or []
        values: list[bytes | None] = []
        for response in responses:
            kvs = response.get("response_range", {}).get("kvs") or []
            values.append(self._value(kvs[0]) if kvs else None)
        return values

    def get_if_set(self, key: str) -> bytes | None:
        """``key``'s value, or ``None`` when it is not set: one request, no waiting."""
        return self._range(key)

    def get(self, key: str) -> bytes:
        """``key``'s value, waiting (a watch) until it is set, at most the store's timeout."""
        value = self._range(key)
        if value is None:
            self.wait([key])
            value = self._range(key)
        if value is None:  # set and deleted again in between: as absent as before the wait
            raise dist.DistStoreError(f"key {key!r} disappeared from the etcd cluster at {self.address}")
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Every key's value (waiting for those not set yet)."""
        values = self._ranges(keys)
        if any(v is None for v in values):
            self.wait(keys)
            values = self._ranges(keys)
        if any(v is None for v in values):
            raise dist.DistStoreError(f"keys {keys!r} disappeared from the etcd cluster at {self.address}")
        return values  # type: ignore[return-value]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Put every key in one transaction."""
        ops = [{"request_put": {"key": _b64(self._key(k)), "value": _b64(v)}} for k, v in zip(keys, values)]
        self._call("/v3/kv/txn", {"success": ops})

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set (one round trip)."""
        return all(v is not None for v in self._ranges(keys))

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """One transaction: ``desired_value`` when ``key`` is absent (``expected_value`` empty) or
        holds ``expected_value``; the value that holds afterwards either way."""
        k = _b64(self._key(key))
        expected = expected_value.encode() if isinstance(expected_value, str) else expected_value
        if expected:
            compare = {"key": k, "target": "VALUE", "result": "EQUAL", "value": _b64(expected)}
        else:
            compare = {"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        reply = self._call("/v3/kv/txn", {"compare": [compare],
                                          "success": [{"request_put": {"key": k, "value": _b64(desired_value)}}],
                                          "failure": [{"request_range": {"key": k}}]})
        if reply.get("succeeded"):
            return desired_value.encode() if isinstance(desired_value, str) else desired_value
        kvs = (reply.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        return self._value(kvs[0]) if kvs else expected  # absent and expected non-empty: nothing set

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (absent: 0) with a compare-and-swap on its
        modification revision, retried until it wins; the new value."""
        k = _b64(self._key(key))
        while True:
            kvs = self._call("/v3/kv/range", {"key": k}).get("kvs") or []
            current, revision = (int(self._value(kvs[0])), kvs[0].get("mod_revision", "0")) if kvs else (0, "0")
            if amount == 0:  # a read: one request
                return current
            new = current + amount
            compare = {"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": revision}
            if self._call("/v3/kv/txn", {"compare": [compare],
                                         "success": [{"request_put": {"key": k, "value": _b64(str(new))}}]}
                          ).get("succeeded"):
                return new

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it was there."""
        return int(self._call("/v3/kv/deleterange", {"key": _b64(self._key(key))}).get("deleted", 0) or 0) > 0

    def num_keys(self) -> int:
        """How many keys this store's root holds in the cluster."""
        reply = self._call("/v3/kv/range", {"key": _b64(self.root), "range_end": _b64(_after(self.root)),
                                            "count_only": True})
        return int(reply.get("count", 0) or 0)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Return once every key is set: a watch on their common prefix from the revision of the
        read that found one missing; past ``timeout`` (default: the store's) ``DistStoreError``."""
        deadline = time.monotonic() + (timeout or self.timeout).total_seconds()
        prefix = _common_prefix([self._key(k) for k in keys])
        while True:
            if self.check(keys):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(f"timed out after {(timeout or self.timeout).total_seconds():.0f} s "
                                          f"waiting for keys {keys!r} in the etcd cluster at {self.address}")
            self._watch(prefix, min(left, WATCH_S))  # a member silent without a reset holds one watch at most

    def await_change(self, prefix: str, seconds: float) -> None:
        """Return when a key under ``prefix`` changed since this store's last read, or after
        ``seconds`` (the link's waits pause here instead of polling)."""
        if seconds > 0:
            self._watch(self._key(prefix), seconds)

    def _watch(self, prefix: bytes, seconds: float) -> bool:
        """Block until a key under ``prefix`` changes after this thread's last read (``True``), or
        ``seconds`` pass (``False``). A member that fails ends the watch early: the caller
        re-reads (through whichever member answers) and watches again."""
        start = getattr(self._local, "revision", 0) + 1
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(_after(prefix)),
                                   "start_revision": str(start)}}
        member = self._member
        deadline = time.monotonic() + seconds
        conn = self._open(member, min(seconds, REQUEST_S))
        try:
            # hasleader: a member cut off from the leader cancels the watch instead of keeping it silent
            headers = {**self._headers(member, min(seconds, REQUEST_S)), "Grpc-Metadata-hasleader": "true"}
            conn.request("POST", "/v3/watch", json.dumps(body), headers)
            reply = conn.getresponse()
            if reply.status != 200:
                time.sleep(min(RETRY_S, seconds))
                return False
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                conn.sock.settimeout(left)
                line = reply.readline()
                if not line:
                    return False
                result = json.loads(line).get("result", {})
                if result.get("events") or result.get("canceled") or result.get("compact_revision"):
                    return True
        except (OSError, http.client.HTTPException, ValueError):
            time.sleep(min(RETRY_S, max(0.0, deadline - time.monotonic())))
            return False
        finally:
            conn.close()
