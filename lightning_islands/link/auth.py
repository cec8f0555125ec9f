"""Authenticated payloads and round headers between islands, from a shared secret.

:class:`AuthenticatedLink` wraps any :class:`~lightning_islands.link.protocol.Link` (the real
:class:`~lightning_islands.link.island_link.IslandLink`, or a test double) and implements the same
interface: every small object (fingerprints, round headers) and every payload carries a MAC keyed
by the shared secret and the run id, and every island checks what every other island sent before
the engine sees it. A payload altered on the way, or sent by a process without the secret (or with
another one), ends in an :class:`AuthenticationError` that names the island, the call and the fix.
``SECURITY.md`` states what this protects and what it does not.

The construction (``SCHEME``):

- key: ``K = HMAC-SHA256(HMAC-SHA256(LABEL, secret), "run" || run_id)`` (HKDF's extract and one
  expand step), so one secret gives every run its own key;
- a small object: its JSON text exactly as sent, and ``HMAC-SHA256(K, "object" || key || island ||
  text)`` in hex next to it; the receiver parses the text only once its MAC matched;
- a payload: 32 bytes appended, a MAC tree over fixed pieces of ``PIECE_BYTES``: each piece's
  ``HMAC-SHA256(K, "leaf" || header || index || piece)``, computed in a thread pool (hashlib
  releases the GIL), and the root ``HMAC-SHA256(K, "root" || header || count || leaf tags)``. The
  header binds the payload to its call: the kind (gather or broadcast), a sequence number that every
  island advances in the same order, the sending island, the source island and the payload's length.

Fields are length-prefixed, so no two different field lists encode to the same bytes. The pieces do
not depend on the thread count, so islands with different core counts compute the same tags.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import Tensor

from lightning_islands.link.protocol import AuthenticationError, DeadlinePassed, Link, LinkStats, RankLink, RoundLost

ENV_SECRET = "LI_SECRET"
ENV_SECRET_FILE = "LI_SECRET_FILE"
SCHEME = "hmac-sha256-tree-v1"
TAG_BYTES = 32
PIECE_BYTES = 4 << 20
MIN_SECRET_BYTES = 16
_LABEL = b"lightning-islands/auth/" + SCHEME.encode()
_GENERATE = "python -c 'import secrets; print(secrets.token_hex(32))'"
_FIX = "give every island the same secret (LI_SECRET or the same secret file; see SECURITY.md)"

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------- secret
def load_secret(path: str | os.PathLike | None = None) -> bytes | None:
    """The shared secret: the file at ``path``, else the file named by ``LI_SECRET_FILE``, else the
    value of ``LI_SECRET``, else ``None`` (no authentication).

    Surrounding whitespace (a trailing newline) is stripped. Refused with an error that names the
    file and the fix: a missing or empty file, a file that its group or other users may read or
    write (``chmod 600`` it, as ssh does for private keys: a secret others can read protects
    nothing), a secret of fewer than 16 bytes, and ``LI_SECRET`` set but empty (unset it to run
    without authentication). The secret itself never appears in a message.
    """
    path = path if path is not None else (os.environ.get(ENV_SECRET_FILE) or None)
    if path is not None:
        return _read_secret_file(Path(path).expanduser())
    value = os.environ.get(ENV_SECRET)
    if value is None:
        return None
    secret = value.strip().encode()
    if not secret:
        raise ValueError(f"{ENV_SECRET} is set but empty: set it to the run's shared secret (e.g. the output of "
                         f"`{_GENERATE}`), or unset it to run without authentication")
    return _checked(secret, ENV_SECRET)


def _read_secret_file(path: Path) -> bytes:
    if not path.is_file():
        raise FileNotFoundError(f"secret file {path} does not exist (or is not a file): create it with "
                                f"`{_GENERATE} > {path} && chmod 600 {path}` and give every island the same one")
    if os.name == "posix":
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise PermissionError(f"secret file {path} has mode {mode:o}: its group or other users may read or write "
                                  f"it, so it is no secret; make it readable by this user only with `chmod 600 {path}`")
    secret = path.read_bytes().strip()
    if not secret:
        raise ValueError(f"secret file {path} is empty: write the run's shared secret into it (e.g. "
                         f"`{_GENERATE} > {path}`)")
    return _checked(secret, f"secret file {path}")


def _checked(secret: bytes, where: str) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the secret in {where} has {len(secret)} bytes, fewer than {MIN_SECRET_BYTES}: use a "
                         f"random one, e.g. the output of `{_GENERATE}`")
    return secret


def derive_key(secret: bytes, run_id: str) -> bytes:
    """The run's MAC key: HKDF-SHA256 (extract with a fixed label, one expand step over the run id)."""
    if not secret:
        raise ValueError("an empty secret authenticates nothing; see load_secret")
    prk = hmac.digest(_LABEL, secret, "sha256")
    return hmac.digest(prk, _fields(b"run", run_id.encode()) + b"\x01", "sha256")


# ---------------------------------------------------------------------------------------- MACs
def _fields(*parts: bytes) -> bytes:
    """Length-prefixed concatenation: distinct field lists never encode to the same bytes."""
    return b"".join(struct.pack(">Q", len(p)) + p for p in parts)


def _int(value: int) -> bytes:
    return struct.pack(">q", value)


def object_mac(key: bytes, name: str, island: int, text: str) -> str:
    """The hex MAC of island ``island``'s JSON ``text`` published under ``name``."""
    return hmac.digest(key, _fields(b"object", name.encode(), _int(island), text.encode()), "sha256").hex()


def store_mac(key: bytes, name: str, value: bytes) -> bytes:
    """The hex MAC (as bytes) of ``value`` written under the coordinator key ``name``
    (:mod:`lightning_islands.link.sealed`)."""
    return hmac.digest(key, _fields(b"store", name.encode(), value), "sha256").hex().encode()


def payload_header(kind: str, epoch: str, seq: int, sender: int, src: int, num_islands: int, length: int) -> bytes:
    """What a payload's tag binds it to besides its bytes (see the module docstring)."""
    return _fields(kind.encode(), epoch.encode(), _int(seq), _int(sender), _int(src), _int(num_islands),
                   _int(length))


def _leaf(key: bytes, header: bytes, index: int, piece: memoryview) -> bytes:
    h = hmac.new(key, _fields(b"leaf", header, _int(index)), "sha256")
    h.update(piece)
    return h.digest()


def payload_tags(key: bytes, items: Sequence[tuple[bytes, memoryview]],
                 pool: ThreadPoolExecutor | None = None) -> list[bytes]:
    """The 32-byte tag of each ``(header, data)``: the root of its MAC tree (module docstring). The
    pieces of all items go through ``pool`` together (``None``: in this thread)."""
    jobs = []
    for k, (header, data) in enumerate(items):
        count = max(1, -(-len(data) // PIECE_BYTES))
        jobs += [(k, header, i, data[i * PIECE_BYTES : (i + 1) * PIECE_BYTES]) for i in range(count)]
    leaves = (pool.map(lambda j: _leaf(key, j[1], j[2], j[3]), jobs) if pool is not None and len(jobs) > 1
              else [_leaf(key, j[1], j[2], j[3]) for j in jobs])
    per_item: list[list[bytes]] = [[] for _ in items]
    for job, leaf in zip(jobs, leaves):
        per_item[job[0]].append(leaf)
    return [hmac.digest(key, _fields(b"root", header, _int(len(tags)), b"".join(tags)), "sha256")
            for (header, _), tags in zip(items, per_item)]


def _bytes_view(t: Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous 1-D uint8 CPU tensor."""
    return memoryview(t.numpy()) if t.numel() else memoryview(b"")


# ---------------------------------------------------------------------------------------- the link
class AuthenticatedLink:
    """A :class:`~lightning_islands.link.protocol.Link` whose objects and payloads carry MACs.

    Wraps ``link`` (any Link: :class:`~lightning_islands.link.island_link.IslandLink` or a test
    double) and implements the whole Protocol: what it does not authenticate itself (membership,
    liveness, status, accounting) it hands to ``link`` method by method. Every island must wrap its link with
    the same ``secret`` and ``run_id``: an island with another secret or none fails at the first
    object (the fingerprints), on every island that checks it, with an :class:`AuthenticationError`
    naming it.

    Integration (the Lightning strategy: one line where it opens its link)::

        from lightning_islands.link.auth import AuthenticatedLink, load_secret

        secret = load_secret(secret_file)   # secret_file: a path from the config, or None (LI_SECRET_FILE, LI_SECRET)
        link = IslandLink(..., secret=secret)   # seals the coordinator values it acts on
        link = AuthenticatedLink(link, secret, run_id) if secret is not None else link

    and put ``"auth": secret is not None`` into the fingerprint, so that an island without the
    secret is also told by the fingerprint comparison. Never put the secret into a config.

    Errors are raised (and logged) on the island that checks; the engine's ``agree`` then aborts
    the link, so the other islands stop too. Payloads and objects are authenticated here; the
    store values the link acts on (decisions, aborts, beats) are sealed by
    :class:`~lightning_islands.link.island_link.IslandLink` given the same secret (``SECURITY.md``).

    Args:
        link: the link to wrap.
        secret: the shared secret (:func:`load_secret`).
        run_id: the run's id (the key is derived from both: one run's messages do not verify in
            another).
        threads: threads that compute the MAC tree of large payloads (default: the usable cores,
            at most 8).
    """

    def __init__(self, link: Link, secret: bytes, run_id: str, threads: int | None = None) -> None:
        if not isinstance(secret, bytes) or not secret:
            raise TypeError("secret must be non-empty bytes (see lightning_islands.link.auth.load_secret)")
        self.link = link
        self.island = link.island
        self.run_id = run_id
        self._key = derive_key(secret, run_id)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.threads = max(1, threads if threads is not None else min(8, cores))
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._epoch = ""
        self._seq = 0
        self.seconds_authenticating = 0.0  # signing and checking, since the last take_stats

    def __repr__(self) -> str:  # never the key
        return f"AuthenticatedLink({self.link!r}, island={self.island}, run_id={self.run_id!r})"

    @property
    def present(self) -> tuple[int, ...]:
        """The islands of the current round (the wrapped link's)."""
        return self.link.present

    @property
    def num_islands(self) -> int:
        """The length of lists in island order (the wrapped link's)."""
        return self.link.num_islands

    @property
    def roster(self) -> tuple[int, ...]:
        """The run's islands (the wrapped link's)."""
        return self.link.roster

    @property
    def lanes_key(self) -> str | None:
        """The key the wrapped link's lanes were built under."""
        return self.link.lanes_key

    @property
    def attempt_key(self) -> str | None:
        """The wrapped link's current round attempt (``None`` where it has none)."""
        return getattr(self.link, "attempt_key", None)

    # ------------------------------------------------------------------ sequence
    def restart_sequence(self, epoch: str) -> None:
        """Start payload sequence numbers anew under ``epoch`` (e.g. after islands rejoined): every
        island must call it at the same point, with the same ``epoch``, which the run never reuses."""
        with self._lock:
            self._epoch, self._seq = epoch, 0

    def _next_seq(self) -> tuple[str, int]:
        with self._lock:
            self._seq += 1
            return self._epoch, self._seq

    def _tags(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bytes]:
        big = sum(len(d) for _, d in items) > PIECE_BYTES
        if big and self.threads > 1 and self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=f"island{self.island}-auth")
        return payload_tags(self._key, items, self._pool if big else None)

    # ------------------------------------------------------------------ objects
    def gather_objects(self, key: str, obj: object) -> list:
        """Every island's JSON-able ``obj`` under ``key``, in island order, each checked against its MAC."""
        text = json.dumps(obj)
        sent = {"auth": SCHEME, "json": text, "mac": object_mac(self._key, key, self.island, text)}
        got = self.link.gather_objects(key, sent)
        problems = [p for p in (self._object_problem(key, i, entry) for i, entry in enumerate(got)) if p]
        if problems:
            raise self._reject(problems)
        return [json.loads(entry["json"]) for entry in got]

    def meet_round(self, round_: int, header: dict) -> list[dict | None]:
        """The wrapped link's round headers (``None``: an island not present), each checked against
        its MAC; when the member set changed, payload sequence numbers start anew under the new
        lanes' key (every member sees the same change at the same round)."""
        key = f"round{round_}"
        text = json.dumps(header)
        sent = {"auth": SCHEME, "json": text, "mac": object_mac(self._key, key, self.island, text)}
        got = self.link.meet_round(round_, sent)
        problems = [p for p in (self._object_problem(key, i, e) for i, e in enumerate(got) if e is not None) if p]
        if problems:
            raise self._reject(problems)
        lanes = self.link.lanes_key
        if lanes is not None and lanes != self._epoch:
            self.restart_sequence(lanes)
        return [None if e is None else json.loads(e["json"]) for e in got]

    def _object_problem(self, key: str, island: int, entry: object) -> str | None:
        """What is wrong with island ``island``'s entry under ``key``, or ``None``."""
        what = f"round header {key!r}" if key.startswith("round") else f"object {key!r}"
        if not (isinstance(entry, dict) and "mac" in entry and "json" in entry):
            return (f"island {island} sent {what} without authentication: it runs without a secret (no "
                    f"{ENV_SECRET}) while island {self.island} has one, or another process wrote it; {_FIX}")
        if entry.get("auth") != SCHEME:
            return (f"island {island} authenticates {what} with {entry.get('auth')!r}, island {self.island} with "
                    f"{SCHEME!r}: run the same lightning_islands version on every island")
        text, mac = entry["json"], entry["mac"]
        if not (isinstance(text, str) and isinstance(mac, str) and hmac.compare_digest(
                object_mac(self._key, key, island, text).encode(), mac.encode("utf-8", "replace"))):
            return (f"island {island}'s {what} does not match its MAC: it was altered on the way, or island "
                    f"{island} has a different secret than island {self.island} (or another process wrote it); "
                    f"{_FIX}")
        return None

    def _reject(self, problems: Sequence[str]) -> AuthenticationError:
        """The error naming every island whose entry failed (one per line), also logged."""
        message = "\n  ".join(problems)
        log.error("lightning_islands: island %d rejected: %s", self.island, message)
        return AuthenticationError(message)

    # ------------------------------------------------------------------ payloads
    def _signed(self, payload: Tensor, header: bytes) -> Tensor:
        """``payload`` (uint8, any device) with its tag appended: one copy, into host memory."""
        n = payload.numel()
        out = torch.empty(n + TAG_BYTES, dtype=torch.uint8)
        view = _bytes_view(out)
        if payload.device.type == "cpu":  # a plain memcpy in this thread (torch's copy_ may wake its
            view[:n] = _bytes_view(payload.detach().contiguous())  # thread pool: slow on a busy host)
        else:
            out[:n].copy_(payload.detach())
        view[n:] = self._tags([(header, view[:n])])[0]
        return out

    def _check(self, what: str, islands: Sequence[int], received: Sequence[Tensor],
               headers: Sequence[bytes]) -> None:
        """Raise naming every island in ``islands`` whose payload (``received``) fails its tag."""
        problems: list[tuple[int, str]] = []
        todo = []
        for i, t, h in zip(islands, received, headers):
            if t.numel() >= TAG_BYTES:
                todo.append((i, _bytes_view(t.detach().cpu().contiguous()), h))
                continue
            problems.append((i, f"island {i}'s payload of {what} has {t.numel()} bytes, fewer than its {TAG_BYTES}-"
                                f"byte tag: island {i} runs without a secret (no {ENV_SECRET}) while island "
                                f"{self.island} has one, or it was cut on the way; {_FIX}"))
        expected = self._tags([(h, v[:-TAG_BYTES]) for _, v, h in todo])
        for (i, v, _), tag in zip(todo, expected):
            if hmac.compare_digest(tag, bytes(v[-TAG_BYTES:])):
                continue
            problems.append((i, f"island {i}'s payload of {what} ({len(v) - TAG_BYTES} bytes) does not match its "
                                f"tag: it was altered on the way, or island {i} has a different secret than island "
                                f"{self.island}, or none; {_FIX}"))
        if problems:
            raise self._reject([p for _, p in sorted(problems)])

    def all_gather_bytes(self, payload: Tensor, limit: int | None = None) -> list[Tensor]:
        """Every island's 1-D uint8 payload, in island order, each checked against its tag (sizes
        above ``limit`` refused before they are received)."""
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise TypeError("payload must be a 1-D uint8 tensor")
        epoch, seq = self._next_seq()
        n = self.num_islands

        def header(i: int, length: int) -> bytes:
            return payload_header("gather", epoch, seq, i, i, n, length)

        t0 = time.perf_counter()
        signed = self._signed(payload, header(self.island, payload.numel()))
        t1 = time.perf_counter()
        got = self.link.all_gather_bytes(signed, None if limit is None else limit + TAG_BYTES)
        t2 = time.perf_counter()
        others = [i for i in self.link.present if i != self.island]
        what = f"all_gather_bytes call {seq}" + (f" of epoch {epoch!r}" if epoch else "")
        self._check(what, others, [got[i] for i in others],
                    [header(i, max(0, got[i].numel() - TAG_BYTES)) for i in others])
        self._account(t1 - t0 + time.perf_counter() - t2)
        return [t[:-TAG_BYTES] if i in others or i == self.island else t for i, t in enumerate(got)]

    def broadcast_bytes(self, payload: Tensor | None, src: int = 0, limit: int | None = None) -> Tensor:
        """Island ``src``'s uint8 payload on every island, checked against its tag (``limit``: as
        :meth:`all_gather_bytes`)."""
        epoch, seq = self._next_seq()

        def header(length: int) -> bytes:
            return payload_header("broadcast", epoch, seq, src, src, self.num_islands, length)

        t0 = time.perf_counter()
        signed = None
        if self.island == src:
            mine = payload if payload is not None else torch.empty(0, dtype=torch.uint8)
            signed = self._signed(mine, header(mine.numel()))
        t1 = time.perf_counter()
        got = self.link.broadcast_bytes(signed, src=src, limit=None if limit is None else limit + TAG_BYTES)
        t2 = time.perf_counter()
        if self.island != src:
            what = f"broadcast_bytes call {seq} from island {src}" + (f" of epoch {epoch!r}" if epoch else "")
            self._check(what, [src], [got], [header(max(0, got.numel() - TAG_BYTES))])
        self._account(t1 - t0 + time.perf_counter() - t2)
        return got[:-TAG_BYTES]

    def swap_bytes(self, payload: Tensor, peers: Sequence[int], limit: int | None = None) -> dict[int, Tensor]:
        """Swap ``payload`` with ``peers`` (:meth:`Link.swap_bytes`), each received payload checked
        against its tag, which binds its sender and the call (``limit``: as :meth:`all_gather_bytes`)."""
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise TypeError("payload must be a 1-D uint8 tensor")
        epoch, seq = self._next_seq()

        # bound to its sender and the call: a receiver accepts only its own peers' payloads of this call
        # (the islands of a swap may name different peer sets: a repair's source names every island it
        # repairs, each of them only the source)
        def header(i: int, length: int) -> bytes:
            return payload_header("swap", epoch, seq, i, i, self.num_islands, length)

        t0 = time.perf_counter()
        signed = self._signed(payload, header(self.island, payload.numel()))
        t1 = time.perf_counter()
        got = self.link.swap_bytes(signed, peers, None if limit is None else limit + TAG_BYTES)
        t2 = time.perf_counter()
        islands = sorted(got)
        what = f"swap_bytes call {seq}" + (f" of epoch {epoch!r}" if epoch else "")
        self._check(what, islands, [got[i] for i in islands],
                    [header(i, max(0, got[i].numel() - TAG_BYTES)) for i in islands])
        self._account(t1 - t0 + time.perf_counter() - t2)
        return {i: got[i][:-TAG_BYTES] for i in islands}

    def _account(self, seconds: float) -> None:
        with self._lock:
            self.seconds_authenticating += seconds

    # ------------------------------------------------------------------ the rest of Link
    def open_lanes(self) -> None:
        """Open the wrapped link's lanes."""
        self.link.open_lanes()

    def settle_round(self) -> None:
        """The wrapped link's settling of the round (its decisions are sealed there, given the secret)."""
        self.link.settle_round()

    def end_run(self, round_: int) -> None:
        """Record the run's last round, on the wrapped link."""
        self.link.end_run(round_)

    def rejoin(self, timeout_s: float, from_round: int = 0, every: int = 1) -> int:
        """Ask to be taken back, on the wrapped link."""
        return self.link.rejoin(timeout_s, from_round, every)

    def retire_after(self, round_: int) -> None:
        """Leave the run for good after round ``round_``, on the wrapped link."""
        self.link.retire_after(round_)

    def publish(self, key: str, obj: object) -> None:
        """Publish ``obj`` under ``key``, with its MAC (bound to this island as its author)."""
        text = json.dumps(obj)
        self.link.publish(key, {"auth": SCHEME, "json": text, "mac": object_mac(self._key, key, self.island, text),
                                "from": self.island})

    def read_object(self, key: str, timeout_s: float) -> object:
        """The object an island published under ``key``, checked against its MAC."""
        entry = self.link.read_object(key, timeout_s)
        author = entry.get("from") if isinstance(entry, dict) else None
        problem = self._object_problem(key, author if isinstance(author, int) else -1, entry)
        if problem:
            raise self._reject([problem])
        return json.loads(entry["json"])  # type: ignore[index]

    def membership_changes(self) -> list[str]:
        """The wrapped link's member-set changes since the last call."""
        return self.link.membership_changes()

    def heartbeat(self, status: dict) -> None:
        """Publish this island's status, on the wrapped link (not authenticated)."""
        self.link.heartbeat(status)

    def beating(self, status: dict, period: float | None = None) -> AbstractContextManager[None]:
        """Keep this island's status changing while the body runs, on the wrapped link."""
        return self.link.beating(status, period)

    def take_stats(self) -> LinkStats:
        """The wrapped link's counters; the time spent signing and checking counts as exchanging."""
        stats = self.link.take_stats()
        with self._lock:
            seconds, self.seconds_authenticating = self.seconds_authenticating, 0.0
        stats.seconds_exchanging += seconds
        return stats

    def fail_round(self, why: str) -> RoundLost | DeadlinePassed:
        """The wrapped link's :meth:`~lightning_islands.link.protocol.Link.fail_round`."""
        return self.link.fail_round(why)

    def add_wait(self, seconds: float) -> None:
        """Count ``seconds`` as waiting, on the wrapped link."""
        self.link.add_wait(seconds)

    def abort(self, message: str) -> None:
        """Tell the other islands that this one failed (sealed by the wrapped link, given the secret)."""
        self.link.abort(message)

    def close(self) -> None:
        """Stop the MAC threads and close the wrapped link."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.link.close()


class AuthenticatedRankLink(AuthenticatedLink):
    """A :class:`~lightning_islands.link.protocol.RankLink` whose payloads carry MACs (the sliced
    exchange with a secret): :meth:`AuthenticatedLink.all_gather_bytes` on rank ``rank``'s own lanes.
    Its sequence starts anew with every member set, under an epoch that names the lanes' key and the
    rank, so a payload moved from one rank's lanes to another's, or from another member set, does not
    verify. Every island's rank ``rank`` must wrap its lanes with the same ``secret`` and ``run_id``."""

    def __init__(self, link: RankLink, secret: bytes, run_id: str, rank: int, threads: int | None = None) -> None:
        super().__init__(link, secret, run_id, threads)  # type: ignore[arg-type]  # the calls it makes, a RankLink has
        self.rank = rank

    def __repr__(self) -> str:  # never the key
        return f"AuthenticatedRankLink({self.link!r}, rank={self.rank}, run_id={self.run_id!r})"

    def use(self, present: tuple[int, ...], lanes_key: str | None, attempt: str | None = None) -> None:
        """The round's islands present and their lanes' key (:meth:`RankLink.use`)."""
        self.link.use(present, lanes_key, attempt)  # type: ignore[attr-defined]
        epoch = f"{lanes_key}/rank{self.rank}"
        if epoch != self._epoch:
            self.restart_sequence(epoch)
