"""Coordinator values an island can trust: :class:`SealedStore`.

With a shared secret, every value an island acts on (member sets, outcomes, "done"s, headers, join
requests, the end of the run, abort reports, liveness beats) is written sealed: its MAC comes first,
``HMAC-SHA256(K, "store" || key || value)`` in hex, with ``K`` the run's key
(:func:`~lightning_islands.link.auth.derive_key`). The key names the run, the round and the attempt
(``run/round3/a1/members``), so a value copied from another run, round or attempt does not verify
under its new key, and one written by a process without the secret does not verify at all. A value
that fails is refused with :class:`~lightning_islands.link.protocol.AuthenticationError` naming the
key (and logged): the island ends with that error rather than act on it.

What it cannot do: keep the coordinator (or anyone who reaches it) from withholding or deleting
values (the islands then wait until their deadline), or from replaying a value at the very key it
was written under (beats, join requests and failure reports carry the writer's incarnation, so
the membership ignores those of an earlier life). Counters (``add``), the launcher's status lines
and gloo's lanes rendezvous are not sealed (a forged rendezvous address can only withhold: every
payload carries its own MAC).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence

import torch.distributed as dist

from lightning_islands.link.auth import store_mac
from lightning_islands.link.protocol import AuthenticationError

TAG_HEX = 64  # the hex MAC in front of every sealed value
_FIX = "give every island the same secret (LI_SECRET or the same secret file; see SECURITY.md)"

log = logging.getLogger(__name__)


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SealedStore:
    """A coordinator client whose values carry a MAC under the run's ``key`` (module docstring).

    Implements the store calls the link makes: values pass through :meth:`set`, :meth:`get`,
    :meth:`multi_get` and :meth:`compare_set` sealed and checked; :meth:`check`, :meth:`add`,
    :meth:`delete_key` and :meth:`num_keys` do not touch values. ``island`` names the checking
    island in errors.
    """

    def __init__(self, store: dist.Store, key: bytes, island: int) -> None:
        self.store, self._key, self.island = store, key, island

    def __repr__(self) -> str:  # never the key
        return f"SealedStore(island={self.island})"

    def _seal(self, name: str, value: str | bytes) -> bytes:
        data = _as_bytes(value)
        return store_mac(self._key, name, data) + data

    def _open(self, name: str, raw: bytes) -> bytes:
        data = raw[TAG_HEX:]
        if len(raw) >= TAG_HEX and hmac.compare_digest(raw[:TAG_HEX], store_mac(self._key, name, data)):
            return data
        last = name.rsplit("/", 1)[-1]
        whose = f"island {last}'s value" if last.isdigit() else "the value"
        if not (len(raw) >= TAG_HEX and all(c in b"0123456789abcdef" for c in raw[:TAG_HEX])):
            why = (f"it carries no MAC: {'island ' + last if last.isdigit() else 'its writer'} runs without the "
                   f"run's secret while island {self.island} has one, or a process without it wrote it (forged)")
        else:
            why = ("it does not match its MAC: it was written with another secret, or copied there from another "
                   "key (another run, round or attempt: replayed), or altered")
        message = f"island {self.island} refused {whose} under {name!r} at the coordinator: {why}; {_FIX}"
        log.error("lightning_islands: %s", message)
        raise AuthenticationError(message)

    def set(self, name: str, value: str | bytes) -> None:
        """Write ``value`` sealed under ``name``."""
        self.store.set(name, self._seal(name, value))

    def get(self, name: str) -> bytes:
        """The value under ``name`` (waits for it as the store does), checked."""
        return self._open(name, self.store.get(name))

    def get_if_set(self, name: str) -> bytes | None:
        """The value under ``name``, checked, or ``None`` when there is none (no waiting)."""
        from lightning_islands.link.coordinator import get_if_set

        raw = get_if_set(self.store, name)
        return None if raw is None else self._open(name, raw)

    def multi_get(self, names: Sequence[str]) -> list[bytes]:
        """The values under ``names`` in one request, each checked."""
        return [self._open(n, raw) for n, raw in zip(names, self.store.multi_get(list(names)))]

    def compare_set(self, name: str, expected: str, desired: str | bytes) -> bytes:
        """Write ``desired`` under ``name`` unless a value is there (``expected`` must be ``""``:
        sealed values cannot be compared by content); the value that holds afterwards, checked."""
        if expected != "":
            raise ValueError("a sealed store compares only against an absent value (expected='')")
        return self._open(name, self.store.compare_set(name, "", self._seal(name, desired)))

    def check(self, names: Sequence[str]) -> bool:
        """Whether every key in ``names`` holds a value."""
        return self.store.check(list(names))

    def add(self, name: str, amount: int) -> int:
        """Add to the (unsealed) counter ``name``."""
        return self.store.add(name, amount)

    def delete_key(self, name: str) -> bool:
        """Delete ``name``."""
        return self.store.delete_key(name)

    def num_keys(self) -> int:
        """How many keys the coordinator holds."""
        return self.store.num_keys()
