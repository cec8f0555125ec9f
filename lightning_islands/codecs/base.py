"""The :class:`Codec` interface: header, checksum and validation around a codec's body format."""

from __future__ import annotations

import math
import struct
from typing import Any

import torch
from torch import Tensor

from lightning_islands.codecs.buffers import Buffers
from lightning_islands.codecs.checksum import crc32_of
from lightning_islands.codecs.wire import (
    CODEC_NAMES,
    CRC_OFFSET,
    FORMAT_VERSION,
    HEADER,
    HEADER_BYTES,
    KIND_DENSE,
    MAGIC,
    describe,
    header_bytes,
)


def check_input(x: Tensor) -> Tensor:
    """``x`` made contiguous, after checking it is a flat float32 tensor (TypeError / ValueError if not)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"expected a float32 tensor, got {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"expected a 1-D (flat) tensor, got shape {tuple(x.shape)}")
    return x.contiguous()


def nonfinite_error(x: Tensor) -> ValueError | None:
    """The error to raise if ``x`` holds NaN/Inf, else None (exact count, only on the slow path)."""
    bad = ~torch.isfinite(x)
    count = int(bad.sum())
    if count == 0:
        return None
    nans = int(torch.isnan(x).sum())
    return ValueError(
        f"pseudo-gradient has {count} non-finite values ({nans} NaN, {count - nans} +/-Inf) out of "
        f"{x.numel()}: the inner optimization diverged. Lower the learning rate (or clip "
        f"gradients) and resume from the last good checkpoint; refusing to ship it to other islands."
    )


def raise_if_nonfinite_sum(x: Tensor) -> None:
    """One read pass: a finite sum proves every element finite; otherwise count exactly.

    (A non-finite sum of finite values, i.e. overflow, falls through the exact count harmlessly.)
    """
    if x.numel() and not math.isfinite(float(x.sum())):
        err = nonfinite_error(x)
        if err is not None:
            raise err


class Codec:
    """A pseudo-gradient codec: flat fp32 tensor <-> uint8 payload (32-byte header + body).

    Subclasses implement the body format through ``_values_nbytes``, ``_encode_values`` and
    ``_decode_values``; the header, checksum and validation live here.
    """

    name: str = "codec"
    codec_id: int = 0
    kind: int = KIND_DENSE
    block_size: int | None = None
    bits: float = 32.0  # nominal bits per transmitted value

    # -- body format hooks (per carried value count m) ------------------------------------------
    def _values_nbytes(self, m: int) -> int:
        raise NotImplementedError

    def _encode_values(self, v: Tensor, body: Tensor) -> None:
        raise NotImplementedError

    def _decode_values(self, body: Tensor, m: int, out: Tensor) -> None:
        raise NotImplementedError

    # -- overridable for sparse codecs ----------------------------------------------------------
    def _count(self, n: int) -> int:
        """Number of values carried for an input of n elements."""
        return n

    def _body_nbytes(self, n: int) -> int:
        return self._values_nbytes(n)

    # scratch: where a body format takes large temporaries from (the caller's, see Codec.encode, or
    # one for this call)
    def _encode_body(self, x: Tensor, body: Tensor, scratch: Buffers) -> None:
        self._encode_values(x, body)

    def _decode_body(self, body: Tensor, n: int, k: int, out: Tensor, scratch: Buffers) -> None:
        self._decode_values(body, n, out)

    # -- public API -----------------------------------------------------------------------------
    def nbytes(self, n: int) -> int:
        """Exact payload size in bytes (header included) for an input of ``n`` elements."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return HEADER_BYTES + self._body_nbytes(n)

    @property
    def alignment(self) -> int:
        """Values per unit of the encoding: a vector encoded in pieces that start at multiples of
        this many values decodes to the same values as the vector encoded whole (1 for an
        element-wise codec; whole blocks, and packing groups, for a blockwise one). Top-k selects
        within each piece regardless; its alignment is its quantizer's."""
        return 1

    def spec(self) -> dict[str, Any]:
        """Everything that determines the wire format, for run fingerprints."""
        return {
            "codec": self.name,
            "family": CODEC_NAMES.get(self.codec_id, "?"),
            "block_size": self.block_size,
            "k_fraction": None,
            "index_encoding": None,
            "format_version": FORMAT_VERSION,
        }

    def encode(self, x: Tensor, out: Tensor | None = None, scratch: Buffers | None = None) -> Tensor:
        """Quantize a flat float32 tensor into a 1-D uint8 payload on the same device.

        ``out`` (optional): a contiguous uint8 tensor of exactly ``nbytes(x.numel())`` bytes on
        ``x``'s device to write the payload into (reusing a buffer avoids page-faulting fresh
        memory on every call). ``scratch`` (optional): a :class:`~lightning_islands.codecs.buffers.Buffers`
        that a codec with large temporaries (top-k) takes them from, for a caller that encodes
        many times. Raises ``ValueError`` if ``x`` contains NaN/Inf. Identical input gives
        identical bytes.
        """
        x = check_input(x)
        n = x.numel()
        size = self.nbytes(n)
        if out is None:
            payload = torch.empty(size, dtype=torch.uint8, device=x.device)
        else:
            if (
                out.dtype != torch.uint8
                or out.dim() != 1
                or out.numel() != size
                or not out.is_contiguous()
                or out.device != x.device
                or out.storage_offset() % 4
            ):
                raise ValueError(
                    f"out must be a contiguous, 4-byte aligned 1-D uint8 tensor of {size} bytes on "
                    f"{x.device}, got {out.dtype} shape {tuple(out.shape)} on {out.device}"
                )
            payload = out
        body = payload[HEADER_BYTES:]
        self._encode_body(x, body, scratch if scratch is not None else Buffers())
        header = HEADER.pack(
            MAGIC, FORMAT_VERSION, self.codec_id, self.kind, self.block_size or 0, n, self._count(n), 0
        )[:CRC_OFFSET]
        header += struct.pack("<I", crc32_of(header, body))
        payload[:HEADER_BYTES].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        return payload

    def decode(self, payload: Tensor, out: Tensor | None = None, scratch: Buffers | None = None) -> Tensor:
        """Validate a payload and reconstruct the float32 tensor (same device as the payload).

        ``out`` (optional): a contiguous float32 tensor of the original length on the payload's
        device to decode into, avoiding a fresh allocation (large fresh CPU allocations cost
        page faults that can exceed the decode itself); ``scratch`` as for :meth:`encode`.
        Raises ``ValueError`` on any mismatch (wrong codec, truncation, corruption) with expected
        vs. got values, before anything is written to ``out``.
        """
        if isinstance(payload, Tensor) and (not payload.is_contiguous() or payload.storage_offset() % 4):
            payload = payload.clone(memory_format=torch.contiguous_format)  # fp32 views need alignment
        n, k, raw = self._validate_header(payload)
        body = payload[HEADER_BYTES:]
        # check first: decoding a corrupted body could fail with a misleading error
        self._verify_crc(raw, crc32_of(raw[:CRC_OFFSET], body))
        if out is None:
            out = torch.empty(n, dtype=torch.float32, device=payload.device)
        elif (
            out.dtype != torch.float32
            or out.dim() != 1
            or out.numel() != n
            or not out.is_contiguous()
            or out.device != payload.device
        ):
            raise ValueError(
                f"out must be a contiguous 1-D float32 tensor of {n} elements on {payload.device}, got "
                f"{out.dtype} shape {tuple(out.shape)} on {out.device}"
            )
        self._decode_body(body, n, k, out, scratch if scratch is not None else Buffers())
        return out

    def _validate_header(self, payload: Tensor) -> tuple[int, int, bytes]:
        """Check everything but the checksum; ``(n, k, header bytes)``."""
        raw = header_bytes(payload)
        magic, version, codec_id, kind, block, n, k, crc = HEADER.unpack(raw)
        if magic != MAGIC:
            raise ValueError(f"not a lightning_islands codec payload: magic {magic!r}, expected {MAGIC!r}")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"payload format version {version}, but this build reads version {FORMAT_VERSION} "
                f"(islands running different lightning_islands versions?)"
            )
        mine = (self.codec_id, self.kind, self.block_size or 0)
        if (codec_id, kind, block) != mine:
            raise ValueError(
                f"codec mismatch: payload was encoded as {describe(codec_id, kind, block)} but this "
                f"codec is {describe(*mine)} ({self.name!r}); all islands must use the same codec spec"
            )
        expected_k = self._count(n)
        if k != expected_k:
            raise ValueError(
                f"payload carries k={k} values for n={n}, but codec {self.name!r} carries "
                f"k={expected_k} (different top-k fraction, or a corrupted header)"
            )
        expected_len = self.nbytes(n)
        got_len = payload.numel()
        if got_len != expected_len:
            what = "truncated" if got_len < expected_len else "has trailing bytes"
            raise ValueError(
                f"payload {what}: {got_len} bytes, expected {expected_len} for codec {self.name!r} and n={n}"
            )
        return n, k, raw

    @staticmethod
    def _verify_crc(raw: bytes, actual: int) -> None:
        """Raise if ``actual`` (the CRC-32 of header bytes [0, 28) + body) is not the header's."""
        (crc,) = struct.unpack_from("<I", raw, CRC_OFFSET)
        if actual != crc:
            raise ValueError(
                f"payload checksum mismatch: header says crc32=0x{crc:08x}, header+body hash to "
                f"0x{actual:08x}; the payload was corrupted in transit"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)
