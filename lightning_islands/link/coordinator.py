"""The coordinator: the store every island meets through, and how an island finds it.

A coordinator is a c10d ``TCPStore`` server that outlives any island (:class:`Coordinator`; the
launcher or ``lightning-islands coordinator`` runs one), or an etcd cluster
(``etcd://h1:2379,h2:2379,h3:2379``, :mod:`lightning_islands.link.etcd_store`) that keeps answering
while a majority of its members is up. An island learns its index, the island count, the
coordinator's address and the run's id from its arguments or the environment
(:func:`island_identity`); every key of a run lives under its run id. :func:`connector` opens a
client of either kind.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch.distributed as dist

ENV_ISLAND = "LI_ISLAND"
ENV_NUM_ISLANDS = "LI_NUM_ISLANDS"
ENV_COORDINATOR = "LI_COORDINATOR"
ENV_RUN_ID = "LI_RUN_ID"
# 1: this island joins a run already under way (an index of its own, beyond those the run started with)
ENV_JOIN = "LI_JOIN"
# The network interface the lanes bind to (the launcher's shaped link sets it to the island's veth);
# unset, they use gloo's default device (GLOO_SOCKET_IFNAME, else this host's name).
ENV_LINK_IFNAME = "LI_LINK_IFNAME"
# How many times this island was restarted (torch.distributed.run sets it; 0: the first start).
ENV_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


_ABSENT = "\x00lightning_islands: no value\x00"  # compared against: no key ever holds it


def get_if_set(store: dist.Store, key: str) -> bytes | None:
    """``key``'s value in ``store``, or ``None`` when it is not set: one request, no waiting. A
    check and then a get would wait out the store's timeout for a key deleted in between (a round
    the sweeper removes, a join request withdrawn), or read it as empty; a ``compare_set`` against a
    value no key holds returns the value there, or that value itself, writing nothing, when there
    is none. A store with a ``get_if_set`` of its own (etcd's) reads with it."""
    own = getattr(store, "get_if_set", None)
    if own is not None:
        return own(key)
    value = store.compare_set(key, _ABSENT, _ABSENT)
    return None if value == _ABSENT.encode() else value


def absent(store: dist.Store, keys: Mapping[int, str]) -> list[int]:
    """The islands whose key in ``keys`` (island -> key) is not set in ``store``, ascending."""
    return [i for i, key in sorted(keys.items()) if not store.check([key])]


def restart_count() -> int:
    """This island's start count: 0 the first time, then 1, 2, ... after each restart."""
    return _env_int(ENV_RESTART_COUNT) or 0


def parse_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` (the coordinator address) into its parts, with a clear error."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"coordinator address {address!r} is not of the form HOST:PORT or etcd://HOST:PORT,...; pass e.g. "
            f"coordinator='127.0.0.1:29400' or set {ENV_COORDINATOR}"
        )
    return host, int(port)


def check_address(address: str) -> None:
    """Raise a ValueError naming the fix unless ``address`` is ``HOST:PORT`` or ``etcd://HOST:PORT,...``."""
    from lightning_islands.link.etcd_store import is_etcd, parse_etcd

    parse_etcd(address) if is_etcd(address) else parse_address(address)


def connector(address: str, timeout: timedelta, lease_ttl: float | Callable[[], float] | None = None,
              connect_s: float = 5.0) -> Callable[[], dist.Store]:
    """A function that opens a new client of the coordinator at ``address``.

    ``HOST:PORT``: a TCPStore client, after a plain socket checked (at most ``connect_s``) that the
    coordinator accepts connections (the store's own client retries an unreachable address for
    ``timeout`` in a native thread, and one still retrying when the interpreter exits aborts the
    process). ``etcd://...``: an :class:`~lightning_islands.link.etcd_store.EtcdStore` (``lease_ttl``,
    seconds or a function asked at each write: every key it writes lives under a lease renewed on
    each write; ignored for a TCPStore)."""
    from lightning_islands.link.etcd_store import EtcdStore, is_etcd

    if is_etcd(address):
        check_address(address)
        return lambda: EtcdStore(address, timeout, lease_ttl)
    host, port = parse_address(address)

    def connect() -> dist.Store:
        with socket.create_connection((host, port), timeout=min(timeout.total_seconds(), connect_s)):
            pass
        return dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return connect


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError as err:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from err


def joining_from_env(join: bool | None = None) -> bool:
    """``join``, else whether ``LI_JOIN`` is 1 (this island joins a run under way)."""
    if join is not None:
        return bool(join)
    value = os.environ.get(ENV_JOIN, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"environment variable {ENV_JOIN}={value!r} must be 1 (join a run under way) or 0")
    return value == "1"


def island_identity(island: int | None = None, num_islands: int | None = None, coordinator: str | None = None,
                    run_id: str | None = None, join: bool = False) -> tuple[int, int, str | None, str]:
    """``(island, num_islands, coordinator, run_id)``: each argument, else from the environment
    (``LI_ISLAND``, ``LI_NUM_ISLANDS``, ``LI_COORDINATOR``, ``LI_RUN_ID``), else island 0 of 1, no
    coordinator, run id ``"islands"``. Raises a ValueError naming the fix for an index out of range
    or several islands without a coordinator. ``join``: the island joins a run under way, with any
    index (``num_islands`` is then at least one more than it)."""
    island = island if island is not None else (_env_int(ENV_ISLAND) or 0)
    num_islands = num_islands if num_islands is not None else (_env_int(ENV_NUM_ISLANDS) or 1)
    if join:
        if island < 0:
            raise ValueError(f"island index {island} must be >= 0")
        num_islands = max(num_islands, island + 1, 2)
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    if num_islands > 1 and not coordinator:
        raise ValueError(f"{num_islands} islands need a coordinator address: pass coordinator='HOST:PORT' or set "
                         f"{ENV_COORDINATOR} (`lightning-islands run` sets it for you)")
    if not 0 <= island < num_islands:
        raise ValueError(f"island index {island} is outside [0, {num_islands})")
    return island, num_islands, coordinator, run_id or os.environ.get(ENV_RUN_ID) or "islands"


def status_key(run_id: str, island: int) -> str:
    """Where an island's status (its heartbeat, also shown by the launcher) lives in the store."""
    return f"{run_id}/status/{island}"


class Coordinator:
    """A standalone c10d TCPStore server that holds membership and rounds for every island.

    Keep the object alive for as long as islands train; ``port=0`` picks a free port.

    It listens on ``host`` only, on a socket bound here: left to itself, the store listens on
    every interface as IPv6 (``::``), and every peer it accepts is then an IPv4-mapped address
    (``::ffff:127.0.0.1``) that no hosts file names, so the store's reverse lookup of each accepted
    peer (for its logs) asks DNS, in the one thread that serves every client: a DNS query that is
    lost stalls every island's store requests for the resolver's timeout (5 s).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(socket.SOMAXCONN)
            port = listener.getsockname()[1]
            self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=60), master_listen_fd=listener.fileno())
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store owns the descriptor now
        self.host = host
        self.port = self.store.port

    @property
    def address(self) -> str:
        """``host:port`` to hand to islands."""
        return f"{self.host}:{self.port}"

    def status(self, num_islands: int, run_id: str) -> list[dict | None]:
        """The latest status each island of run ``run_id`` published (``None`` where none yet)."""
        return read_status(self.store, num_islands, run_id)


class RemoteCoordinator:
    """A coordinator this process does not serve (an etcd cluster, or a TCPStore started elsewhere),
    as the launcher sees it: its :attr:`address` and the islands' status."""

    def __init__(self, address: str, timeout: timedelta = timedelta(seconds=5)) -> None:
        self.address = address
        self.store = connector(address, timeout)()

    def status(self, num_islands: int, run_id: str) -> list[dict | None]:
        """The latest status each island of run ``run_id`` published (``None`` where none yet, or
        while the coordinator does not answer: the status lines must never end the run)."""
        try:
            return read_status(self.store, num_islands, run_id)
        except Exception:  # noqa: BLE001 - the islands report a lost coordinator themselves
            return [None] * num_islands


def read_status(store: dist.Store, num_islands: int, run_id: str) -> list[dict | None]:
    """The latest status each island of run ``run_id`` published in ``store`` (``None``: none yet)."""
    raw = [get_if_set(store, status_key(run_id, i)) for i in range(num_islands)]
    return [json.loads(r) if r is not None else None for r in raw]
