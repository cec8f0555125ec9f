"""CRC-32 (zlib's polynomial and conditioning) as algebra over GF(2).

A CRC without its conditioning, the *raw* CRC (register starting at 0, no final xor), is linear in
the message bits: the raw CRC of a concatenation ``A + B`` is ``raw(A) * x^(8*len(B)) ^ raw(B)``
(mod the CRC polynomial), and leading zero bytes do not change it. zlib's ``crc32(data, start)``
is that raw CRC plus a term that depends only on ``start`` and the length. So a checksum can be
taken in pieces, in any order, on any device, and joined exactly; :mod:`lightning_islands.codecs`
joins the CRCs of pieces of large payloads that threads took this way, and
:mod:`lightning_islands.codecs.triton_crc` takes the CRC of GPU payloads as a tree of such joins. Plain
Python integers; no torch (zlib-ng's combine, where installed, for speed).
"""

from __future__ import annotations

import functools

__all__ = ["crc32_combine", "crc32_combine_py", "from_raw", "join", "mulmod", "shift", "weight_table"]

POLY_REFLECTED = 0xEDB88320
_X0 = 0x80000000  # the polynomial 1 in zlib's reflected bit order


def mulmod(a: int, b: int) -> int:
    """Product of two polynomials mod the CRC-32 polynomial, in zlib's reflected bit order.

    Bit 31 holds the coefficient of x^0 and bit 0 that of x^31; multiplying by x is a right
    shift, reducing by the polynomial when x^31 falls off the end.
    """
    product = 0
    bit = _X0  # x^0 of a
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = _times_x(b)
    return product


def _times_x(a: int) -> int:
    return (a >> 1) ^ POLY_REFLECTED if a & 1 else a >> 1


def _x_pow_8_pow2() -> list[int]:
    # table[i] = x^(8 * 2^i) mod P: multiplying a CRC by it appends 2^i zero bytes (sans conditioning)
    x8 = _X0
    for _ in range(8):  # x^0 -> x^8 by eight multiplications with x
        x8 = _times_x(x8)
    table = [x8]
    for _ in range(63):
        table.append(mulmod(table[-1], table[-1]))
    return table


_X8_POW2 = _x_pow_8_pow2()


def shift(crc: int, nbytes: int) -> int:
    """``crc * x^(8*nbytes)`` mod P: a raw CRC register after ``nbytes`` more zero bytes."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    i = 0
    while nbytes:
        if nbytes & 1:
            crc = mulmod(_X8_POW2[i], crc)
        nbytes >>= 1
        i += 1
    return crc


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (same value as zlib's).

    With zlib's conditioning (init and final xor both 0xFFFFFFFF) the register contribution of A
    is just shifted by ``8*len(B)`` bit positions, i.e. multiplied by ``x^(8*len_b)`` mod P.
    zlib-ng's C function where it is installed (a dependency of the package: ~0.2 us against
    ~15 us here, and the codecs join a few CRCs per call), else :func:`crc32_combine_py`.
    """
    if _combine_c is None or len_b <= 0:  # zlib versions differ for len_b = 0 (some return crc_a); < 0 raises
        return crc32_combine_py(crc_a, crc_b, len_b)
    return _combine_c(crc_a, crc_b, len_b)


def crc32_combine_py(crc_a: int, crc_b: int, len_b: int) -> int:
    """:func:`crc32_combine` in plain Python (the reference the C function is tested against)."""
    if len_b < 0:
        raise ValueError(f"len_b must be >= 0, got {len_b}")
    return shift(crc_a, len_b) ^ crc_b


try:  # optional here, so that this module needs nothing but Python
    from zlib_ng.zlib_ng import crc32_combine as _combine_c
except ImportError:  # pragma: no cover - zlib-ng is a dependency of the package
    _combine_c = None


def join(pieces: list[tuple[int, int]]) -> int:
    """CRC-32 of the concatenation of pieces given as ``(crc32, nbytes)``, in order (the first
    piece's length does not matter: it is combined onto the CRC of nothing)."""
    crc = 0
    for piece_crc, nbytes in pieces:
        crc = crc32_combine(crc, piece_crc, nbytes)
    return crc


def from_raw(start: int, raw: int, nbytes: int) -> int:
    """``zlib.crc32(data, start)`` from the raw CRC of ``data`` and its length: zlib's register
    starts at ``start ^ 0xFFFFFFFF``, is shifted over the data while the data's raw CRC is added,
    and leaves with a final xor."""
    return shift(start ^ 0xFFFFFFFF, nbytes) ^ raw ^ 0xFFFFFFFF


@functools.cache
def weight_table(bits: int, group: int, step: int, tail: int) -> tuple[tuple[int, ...], ...]:
    """``table[b][i]``: what bit ``b`` of element ``i`` of a group of ``group`` elements adds to the
    raw CRC of the group, where each element stands for ``step`` bytes of message and ``tail`` more
    bytes follow the last one; i.e. ``(1 << b) * x^(8 * (step * (group - 1 - i) + tail))`` mod P.

    Bytes (``bits=8, step=1, tail=1``; a byte's own raw CRC is the byte times x^8) and raw CRCs of
    ``step``-byte pieces (``bits=32, tail=0``) both fold this way: the raw CRC of a group is the
    xor, over its set bits, of these weights.
    """
    if not (0 < bits <= 32 and group > 0 and step > 0 and tail >= 0):
        raise ValueError(f"bad weight table parameters bits={bits} group={group} step={step} tail={tail}")
    stride = shift(_X0, step)
    weight = shift(_X0, tail)  # element group - 1
    columns = []
    for _ in range(group):  # i = group - 1 down to 0
        column = [0] * bits
        w = weight
        for b in range(31, -1, -1):  # bit b is the coefficient of x^(31 - b): weight * x^(31 - b)
            if b < bits:
                column[b] = w
            w = _times_x(w)
        columns.append(column)
        weight = mulmod(weight, stride)
    columns.reverse()
    return tuple(tuple(columns[i][b] for i in range(group)) for b in range(bits))
