"""Codec spec strings (``"int4"``, ``"int8/64"``, ``"topk:0.01+int4"``) to codecs."""

from __future__ import annotations

from fractions import Fraction

from lightning_islands.codecs.base import Codec
from lightning_islands.codecs.blockwise import Float8Codec, IntCodec
from lightning_islands.codecs.dense import BFloat16Codec, Float32Codec
from lightning_islands.codecs.sign import SignCodec
from lightning_islands.codecs.topk import TopKCodec
from lightning_islands.codecs.wire import DEFAULT_BLOCK_SIZE

_SPEC_HELP = (
    "expected 'fp32', 'bf16', 'fp8', 'int8', 'int4', 'int2' or 'sign', optionally with '/<block size>' "
    "(e.g. 'int4/64'), or 'topk:<fraction>' / 'topk:<fraction>+<codec>' (e.g. 'topk:0.01+int4')"
)


def _make_base(text: str, block_size: int, spec: str) -> Codec:
    name, _, block_text = text.partition("/")
    name = name.strip()
    if block_text:
        try:
            block_size = int(block_text)
        except ValueError:
            raise ValueError(f"bad block size {block_text!r} in codec spec {spec!r}") from None
    if name == "fp32":
        return Float32Codec()
    if name == "bf16":
        return BFloat16Codec()
    if name == "fp8":
        return Float8Codec(block_size)
    if name in ("int8", "int4", "int2"):
        return IntCodec(int(name[3:]), block_size)
    if name == "sign":
        return SignCodec(block_size)
    raise ValueError(f"unknown codec {name!r} in spec {spec!r}: {_SPEC_HELP}")


def make_codec(spec: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Codec:
    """Build a codec from a spec string such as ``"int4"``, ``"int8/64"``, ``"topk:0.01+int4"``.

    ``block_size`` applies to blockwise codecs unless the spec names one (``"int4/64"``).
    ``make_codec(codec.name)`` rebuilds an equal codec.
    """
    if not isinstance(spec, str):
        raise TypeError(f"codec spec must be a str, got {type(spec).__name__}")
    text = spec.strip().lower()
    if not text:
        raise ValueError(f"empty codec spec: {_SPEC_HELP}")
    if text.startswith("topk:"):
        frac_text, plus, inner_text = text[5:].partition("+")
        if "/" in frac_text:
            raise ValueError(
                f"bad top-k fraction {frac_text!r} in codec spec {spec!r}: write it as a decimal "
                f"(e.g. 0.01) and put any block size on the inner codec, e.g. 'topk:0.01+int4/64'"
            )
        try:
            frac = Fraction(frac_text.strip())
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"bad top-k fraction {frac_text!r} in codec spec {spec!r}: {_SPEC_HELP}") from None
        inner = _make_base(inner_text, block_size, spec) if plus else Float32Codec()
        return TopKCodec(frac, inner)
    return _make_base(text, block_size, spec)


def default_error_feedback(codec_spec: str | Codec) -> bool:
    """Whether error feedback should be on by default: yes for <= 4 bits and for any top-k."""
    codec = make_codec(codec_spec) if isinstance(codec_spec, str) else codec_spec
    return isinstance(codec, TopKCodec) or codec.bits <= 4
