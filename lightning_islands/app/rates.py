"""Link rates, in bits per second: the one syntax of ``run --link``, ``islands.link`` and ``plan --link-bps``.

A rate is a number (``25``, ``12.5``, ``25e9``) with an optional unit, read without case:

- ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit``, ``pbit`` (powers of 1000), ``kibit`` .. ``tibit``
  (powers of 1024), each also with ``/s`` (``25 Gbit/s``);
- a bare prefix, ``k``, ``m``, ``g``, ``t``, ``p`` (``25G``, ``200M``), or none (``25e9``).

Units that may mean bytes are refused, never guessed: ``bps``, ``kbps``, ``mbps``, ``gbps``, ``tbps``
(tc reads them as bytes per second, most people as bits), and ``B``, ``B/s`` (as in ``GB/s``, which
reads as ``Gb/s`` once case is gone). The message gives the bit form for either reading.
"""

from __future__ import annotations

import math
import re

_PREFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_WORDS = {"": "", "k": "kilo", "m": "mega", "g": "giga", "t": "tera", "p": "peta",
          "ki": "kibi", "mi": "mebi", "gi": "gibi", "ti": "tebi"}
_SYMBOLS = {"": "", "k": "k", "m": "M", "g": "G", "t": "T", "p": "P", "ki": "Ki", "mi": "Mi", "gi": "Gi", "ti": "Ti"}
_BITS = ("", "bit", "bit/s")
_RATE = re.compile(r"((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*(ki|mi|gi|ti|[kmgtp])?\s*(bit/s|bit|bps|b/s|b)?")
_UNLIMITED = ("inf", "infinity", "unlimited")
EXAMPLES = "25gbit, 200mbit, 25G or 25e9"  # what a message suggests


def _number(value: float) -> str:
    """``100.0`` -> ``"100"``, ``12.5`` -> ``"12.5"``: a number as a rate is written."""
    return format(value, ".15g")


def _ambiguity(text: str, number: float, prefix: str, unit: str) -> str:
    """Why ``text`` (``number``, ``prefix``, byte-ish ``unit``) is refused, and the bit forms to write."""
    if unit == "bps":
        why = f"tc reads it as {_WORDS[prefix]}bytes per second, others as {_WORDS[prefix]}bits"
    else:
        why = "B means bytes and b bits, but rates are read without case"
    symbol = _SYMBOLS[prefix]
    return (f"rate {text!r} is ambiguous ({why}): write {_number(number)}{prefix}bit for {_number(number)} "
            f"{symbol}bit/s or {_number(number * 8)}{prefix}bit for {_number(number)} {symbol}B/s")


def parse_rate(text: str, allow_inf: bool = False) -> float:
    """Bits per second from a rate (``25gbit``, ``25G``, ``25e9``, ``1 Gbit/s``; ``inf`` with ``allow_inf``).

    Raises a ValueError that names ``text`` and the form to write: for any unit that may mean bytes
    (``25gbps``, ``25GB/s``), for ``inf`` without ``allow_inf``, and for anything else unreadable.
    """
    cleaned = str(text).strip().lower()
    if cleaned in _UNLIMITED:
        return _unlimited(text, allow_inf)
    m = _RATE.fullmatch(cleaned)
    if not m:
        examples = "25gbit, 200mbit, 25G, 25e9 or inf" if allow_inf else EXAMPLES
        raise ValueError(f"cannot read the rate {text!r}: write bits per second, e.g. {examples} (units bit, "
                         "kbit, mbit, gbit, tbit; bps, kbps, mbps, gbps and tbps are refused as ambiguous)")
    number, prefix, unit = float(m.group(1)), m.group(2) or "", m.group(3) or ""
    if unit not in _BITS:
        raise ValueError(_ambiguity(text, number, prefix, unit))
    bps = number * _PREFIXES[prefix]
    return bps if math.isfinite(bps) else _unlimited(text, allow_inf)


def _unlimited(text: str, allow_inf: bool) -> float:
    """``inf`` where an unlimited rate is allowed, else the ValueError that asks for a finite one."""
    if allow_inf:
        return math.inf
    raise ValueError(f"rate {text!r} is unlimited; give a finite rate in bits per second, e.g. {EXAMPLES}")
