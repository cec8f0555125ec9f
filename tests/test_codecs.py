"""Tests for lightning_islands.codecs: error bounds, wire format, validation, determinism, EF."""

from __future__ import annotations

import contextlib
import math
import os
import struct
import types
import warnings
import zlib
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_islands import codecs as C
from lightning_islands.codecs import (
    ErrorFeedback,
    blockwise,
    checksum,
    compression_ratio,
    crc32,
    default_error_feedback,
    elias_fano,
    make_codec,
    paths,
    quantization_error,
    selection,
    wire,
)
from lightning_islands.codecs.buffers import Buffers

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=_SUPPRESS)
FEW = settings(max_examples=20, deadline=None, suppress_health_check=_SUPPRESS)

ALL_SPECS = [
    "fp32",
    "bf16",
    "fp8",
    "int8",
    "int4",
    "int2",
    "int4/64",
    "int2/4",
    "int8/12",
    "fp8/32",
    "sign",
    "sign/36",
    "topk:0.01",
    "topk:0.05+int4",
    "topk:0.1+int2/16",
    "topk:0.3+int8/64",
    "topk:0.2+fp8",
    "topk:0.5+bf16",
    "topk:1+int4/32",
    "topk:0.1+sign/16",
]
QMAX = {"int8": 127.0, "int4": 7.0, "int2": 1.0}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# On CPU the codecs run the torch reference path, unless LI_TRITON=interpret (and TRITON_INTERPRET=1):
# then the blockwise codecs run the GPU's Triton kernels under Triton's interpreter, and every test
# here checks them (tests/test_triton_kernels.py runs a selection of this file so).
TRITON = paths.triton_mode() == "interpret"


@contextlib.contextmanager
def torch_path():
    """The torch reference path within the block, on every device (``LI_TRITON`` is read per call)."""
    before = os.environ.get("LI_TRITON")
    os.environ["LI_TRITON"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["LI_TRITON"]
        else:
            os.environ["LI_TRITON"] = before


# ----------------------------------------------------------------------------------------------
# data generation
# ----------------------------------------------------------------------------------------------

KINDS = ["gauss", "uniform", "sparse", "const_blocks", "zeros", "mixed_magnitudes", "heavy_tail", "ties"]


def make_vector(n: int, seed: int, log10_scale: float, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = 10.0**log10_scale
    if kind == "gauss":
        x = torch.randn(n, generator=g, dtype=torch.float64) * scale
    elif kind == "uniform":
        x = (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1) * scale
    elif kind == "sparse":
        x = torch.randn(n, generator=g, dtype=torch.float64) * scale
        x[torch.rand(n, generator=g) < 0.9] = 0.0
    elif kind == "const_blocks":  # runs of identical values of random length and sign
        x = torch.empty(n, dtype=torch.float64)
        i = 0
        while i < n:
            run = int(torch.randint(1, 300, (1,), generator=g))
            x[i : i + run] = float(torch.randn(1, generator=g)) * scale
            i += run
    elif kind == "zeros":
        x = torch.zeros(n, dtype=torch.float64)
    elif kind == "mixed_magnitudes":  # 1e-30 .. 1e30 within the same block
        exps = torch.rand(n, generator=g, dtype=torch.float64) * 60 - 30
        signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
        x = signs * torch.pow(10.0, exps)
    elif kind == "heavy_tail":
        x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp(
            torch.randn(n, generator=g, dtype=torch.float64) * 3
        )
        x = x * scale
    elif kind == "ties":  # few distinct magnitudes: many exact ties
        x = torch.randint(-3, 4, (n,), generator=g).double() * scale
    else:  # pragma: no cover
        raise AssertionError(kind)
    x = x.clamp(-1e36, 1e36)
    return x.to(torch.float32)


@st.composite
def vectors(draw: st.DrawFn, max_len: int = 3000) -> torch.Tensor:
    n = draw(st.integers(0, max_len))
    seed = draw(st.integers(0, 2**31 - 1))
    log10_scale = draw(st.floats(-30, 30))
    kind = draw(st.sampled_from(KINDS))
    return make_vector(n, seed, log10_scale, kind)


def block_absmax(v: torch.Tensor, bsz: int) -> torch.Tensor:
    """Per element: absmax of its codec block, float64."""
    m = v.numel()
    nb = -(-m // bsz)
    padded = torch.zeros(nb * bsz, dtype=torch.float64)
    padded[:m] = v.double().abs()
    return padded.view(max(nb, 0), bsz).amax(1).repeat_interleave(bsz)[:m] if nb else padded[:0]


def sign_tree_sums(x: torch.Tensor, bsz: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block of the sign codec, by its definition in numpy: the float64 sum of |x| padded with
    zeros to the next power of two >= bsz and summed by halving (t[i] + t[i + w] for w = span/2,
    ..., 1), and the block's length."""
    v = np.abs(x.numpy().astype(np.float64))
    m = v.size
    span = 1 << (bsz - 1).bit_length()
    nb = -(-m // bsz)
    t = np.zeros((nb, span))
    for b in range(nb):
        t[b, : min(bsz, m - b * bsz)] = v[b * bsz : (b + 1) * bsz]
    while t.shape[1] > 1:
        half = t.shape[1] // 2
        t = t[:, :half] + t[:, half:]
    widths = np.array([min(bsz, m - b * bsz) for b in range(nb)], dtype=np.float64)
    return t[:, 0] if nb else np.zeros(0), widths


def sign_tree_scales(x: torch.Tensor, bsz: int) -> np.ndarray:
    """The sign codec's block scales: the tree sums divided by the block lengths, rounded to fp32."""
    sums, widths = sign_tree_sums(x, bsz)
    return (sums / widths).astype(np.float32)


def sign_reference(x: torch.Tensor, bsz: int) -> torch.Tensor:
    """The sign codec's decode of x: each value's block scale with x's sign bit."""
    magnitude = torch.from_numpy(sign_tree_scales(x, bsz)).repeat_interleave(bsz)[: x.numel()]
    return torch.where(torch.signbit(x), -magnitude, magnitude)


def order_sensitive_vector(n: int, bsz: int, seed: int) -> torch.Tensor:
    """Blocks whose fp32 mean of |x| comes out differently under almost any other order of the
    float64 additions than the sign codec's tree (or with a multiplication by 1/len).

    Per block: two large entries sum exactly to len times the midpoint between two fp32 values
    (the lower one even, so the tie rounds down), and two entries of 0.27-0.34 float64 ulp of that
    sum sit w apart for a random tree level w, with the large ones outside their residue class mod
    w: in the tree the two small ones meet each other first, survive as 0.54-0.68 ulp and lift the
    mean above the tie; an order that adds either of them to a large partial sum first loses it.
    """
    rng = np.random.default_rng(seed)
    x = np.zeros(n, np.float32)
    for s in range(0, n, bsz):
        length = min(bsz, n - s)
        if length < 4:
            x[s : s + length] = rng.standard_normal(length)
            continue
        low = np.float32(rng.uniform(1, 2) * 2.0 ** int(rng.integers(-60, 60)))
        low = np.uint32(low.view(np.uint32) & ~np.uint32(1)).view(np.float32)  # even: a tie rounds down
        total = length * (float(low) + float(np.spacing(low)) / 2)
        big = np.float32(total)
        if float(big) > total:
            big = np.nextafter(big, np.float32(0))
        w = int(rng.choice([1 << k for k in range(24) if (1 << k) < length - 1]))
        p = int(rng.integers(0, length - w))
        others = [j for j in range(length) if j % w != p % w] if w > 1 else []
        others = others if len(others) >= 2 else [j for j in range(length) if j not in (p, p + w)]
        b1, b2 = rng.choice(others, 2, replace=False)
        block = np.zeros(length, np.float32)
        block[b1], block[b2] = big, np.float32(total - float(big))
        block[p], block[p + w] = (np.spacing(total) * rng.uniform(0.27, 0.34, 2)).astype(np.float32)
        x[s : s + length] = block * rng.choice(np.array([1, -1], np.float32), length)
    return torch.from_numpy(x)


def assert_within_bound(codec: C.Codec, x: torch.Tensor, d: torch.Tensor) -> None:
    """Element-wise error bound of a dense codec (x and d are the carried values)."""
    assert d.dtype == torch.float32 and d.shape == x.shape
    assert torch.isfinite(d).all()
    xd, dd = x.double(), d.double()
    err = (xd - dd).abs()
    family = codec.spec()["family"]
    if family == "sign":  # +-mean|x| of the block, bit for bit
        ref = sign_reference(x, codec.block_size)
        same = d.view(torch.int32) == ref.view(torch.int32)
        assert same.all(), f"{codec.name}: d={dd[~same][:3].tolist()} reference={ref[~same][:3].tolist()}"
        return
    if family == "fp32":
        assert torch.equal(x, d)
        return
    if family == "bf16":
        bound = xd.abs() * 2.0**-8 + 2.0**-133
    else:
        a = block_absmax(x, codec.block_size)
        tiny = 2.0**-140  # only matters for blocks whose scale is a denormal
        if family == "fp8":
            s = a / 448.0
            bound = xd.abs() * 2.0**-4 * (1 + 2.0**-16) + s * 2.0**-10 + a * 2.0**-20 + tiny
        else:
            qmax = QMAX[family]
            bound = a / (2 * qmax) + a * 2.0**-20 + tiny
    bad = err > bound
    assert not bad.any(), (
        f"{codec.name}: {int(bad.sum())} elements out of bound, e.g. x={xd[bad][:3].tolist()} "
        f"d={dd[bad][:3].tolist()} bound={bound[bad][:3].tolist()}"
    )


def reference_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """The documented rule, spelled differently: a stable sort by decreasing magnitude (ties keep
    index order), the first k, in index order."""
    return torch.argsort(-x.abs(), stable=True)[:k].sort().values


# ----------------------------------------------------------------------------------------------
# round trips and error bounds
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["fp32", "bf16", "fp8", "int8", "int4", "int2", "int4/64", "int2/4", "int8/12"])
@SETTINGS
@given(x=vectors())
def test_dense_roundtrip_bounds(spec, x):
    codec = make_codec(spec)
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == codec.nbytes(x.numel())
    d = codec.decode(payload)
    assert_within_bound(codec, x, d)
    # zeros stay exactly zero, signs never flip
    assert (d[x == 0] == 0).all()
    assert ((d * x) >= 0).all()


@pytest.mark.parametrize("spec", ["sign", "sign/4", "sign/36", "sign/4096"])
@SETTINGS
@given(x=vectors())
def test_sign_roundtrip_is_the_sign_times_the_block_mean(spec, x):
    codec = make_codec(spec)
    payload = codec.encode(x)
    assert payload.numel() == codec.nbytes(x.numel())
    d = codec.decode(payload)
    assert_within_bound(codec, x, d)  # sign bits kept, magnitude = block mean |x|


def test_sign_error_is_below_int2_at_half_the_value_bits():
    x = make_vector(1 << 18, 4, 0.0, "gauss")
    sign, int2 = make_codec("sign"), make_codec("int2")
    err_sign = quantization_error(x, sign.decode(sign.encode(x)))
    err_int2 = quantization_error(x, int2.decode(int2.encode(x)))
    assert abs(err_sign - math.sqrt(1 - 2 / math.pi)) < 0.01  # the optimum of a 1-bit code on a Gaussian
    assert err_int2 > 0.75 and err_sign < err_int2 - 0.15
    assert compression_ratio(x.numel(), sign.nbytes(x.numel())) > 25.5


@pytest.mark.parametrize("bsz", [4, 12, 16, 36, 128, 4096, 6000])
def test_sign_scales_follow_the_tree_where_the_order_matters(bsz):
    n = max(20 * bsz, 200 * 128) + bsz // 2 + 1  # a partial last block too
    x = order_sensitive_vector(n, bsz, seed=bsz)
    codec = make_codec(f"sign/{bsz}")
    nb = -(-n // bsz)
    got = codec.encode(x)[C.HEADER_BYTES :][: 4 * nb].view(torch.float32).numpy()
    want = sign_tree_scales(x, bsz)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # the data tells the tree from other orders, and a division from a multiplication by 1/len
    v = np.abs(x.numpy().astype(np.float64))
    sums, widths = sign_tree_sums(x, bsz)
    # left to right (not Python's sum(), which compensates its rounding since 3.12)
    serial = np.array([np.add.accumulate(v[b * bsz : (b + 1) * bsz])[-1] for b in range(nb)])
    assert not np.array_equal((serial / widths).astype(np.float32), want)
    if bsz >= 16:  # a tree that pairs neighbours instead of halves
        pairs = np.zeros((nb, 1 << (bsz - 1).bit_length()))
        for b in range(nb):
            pairs[b, : int(widths[b])] = v[b * bsz : (b + 1) * bsz]
        while pairs.shape[1] > 1:
            pairs = pairs[:, 0::2] + pairs[:, 1::2]
        assert not np.array_equal((pairs[:, 0] / widths).astype(np.float32), want)
    if bsz & (bsz - 1) and nb >= 50:  # lengths that are not powers of two: 1/len is inexact
        assert not np.array_equal((sums * (1.0 / widths)).astype(np.float32), want)


def test_sign_decode_flips_the_sign_bit_of_any_scale():
    # a payload that passes its checksum but carries scales our encoder never writes (negative,
    # NaN, Inf): both paths flip the scale's sign bit, so every island decodes the same bits
    codec = make_codec("sign/8")
    x = torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0, -6.0, 7.0, -8.0] * 4)
    payload = codec.encode(x).clone()
    body = payload[C.HEADER_BYTES :]
    odd = torch.tensor([-1.5, float("nan"), float("-inf"), -0.0]).view(torch.int32)
    body[:16].view(torch.int32).copy_(odd)
    crc = zlib.crc32(bytes(body.numpy()), zlib.crc32(bytes(payload[: wire.CRC_OFFSET].numpy())))
    payload[wire.CRC_OFFSET : C.HEADER_BYTES] = torch.tensor(list(struct.pack("<I", crc)), dtype=torch.uint8)
    got = codec.decode(payload).view(torch.int32)
    negative = (torch.signbit(x).to(torch.int32) << 31).view(4, 8)
    expected = (odd.unsqueeze(1) ^ negative).reshape(-1)
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "spec", ["topk:0.01", "topk:0.05+int4", "topk:0.1+int2/16", "topk:0.3+int8/64", "topk:0.2+fp8"]
)
@FEW
@given(x=vectors())
def test_topk_roundtrip_bounds(spec, x):
    codec = make_codec(spec)
    n = x.numel()
    payload = codec.encode(x)
    assert payload.numel() == codec.nbytes(n)
    d = codec.decode(payload)
    assert d.shape == x.shape
    k = codec._count(n)
    assert k == min(n, math.ceil(n * codec.fraction))
    # the carried indices, straight from the Elias-Fano block
    body = payload[C.HEADER_BYTES :]
    idx = elias_fano.ef_decode(body[codec.inner._values_nbytes(k) :], n, k)
    assert idx.numel() == k
    mask = torch.zeros(n, dtype=torch.bool)
    mask[idx] = True
    assert (d[~mask] == 0).all()
    if k and k < n:  # exactly the k largest magnitudes, ties to the lowest indices
        assert x[mask].abs().min() >= x[~mask].abs().max()
        assert torch.equal(idx, reference_topk(x, k))
    assert_within_bound(codec.inner, x[idx], d[idx])


def test_topk_ties_go_to_the_lowest_indices():
    # magnitudes 0.5 / 1 / 2 in a pattern; the k-th largest is 1.0, shared by many entries
    n = 400_003
    g = torch.Generator().manual_seed(11)
    mags = torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (n,), generator=g)]
    x = mags * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    twos = int((mags == 2.0).sum())
    k = twos + 50_000
    codec = C.TopKCodec(Fraction(k, n))
    assert codec._count(n) == k
    d = codec.decode(codec.encode(x))
    kept = torch.nonzero(d).view(-1)
    ones = torch.nonzero(mags == 1.0).view(-1)[:50_000]
    expected = torch.cat([torch.nonzero(mags == 2.0).view(-1), ones]).sort().values
    assert torch.equal(kept, expected)
    assert torch.equal(kept, reference_topk(x, k))
    assert torch.equal(d[kept], x[kept])


def test_topk_keeps_exactly_k_largest():
    codec = make_codec("topk:0.01")
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(1))
    d = codec.decode(codec.encode(x))
    k = math.ceil(100_003 * 0.01)
    kept = d != 0
    assert int(kept.sum()) == k
    ref = reference_topk(x, k)
    assert torch.equal(torch.nonzero(kept).view(-1), ref)
    assert torch.equal(d[kept], x[kept])  # fp32 values travel exactly


@pytest.mark.parametrize("kind", ["gauss", "ties", "sparse", "zeros", "heavy_tail", "const_blocks"])
@pytest.mark.parametrize("fraction", ["0.001", "0.01", "0.2"])
def test_topk_sampled_threshold_selects_an_exact_topk_set(kind, fraction):
    n = 140_009  # large enough for the sampled-threshold path (4 * selection._TOPK_SAMPLE)
    x = make_vector(n, 17, 0.0, kind)
    codec = make_codec(f"topk:{fraction}")
    k = codec._count(n)
    idx = selection.topk_indices(selection.magnitude_bits(x), k)
    assert idx.numel() == k and torch.unique(idx).numel() == k
    mask = torch.zeros(n, dtype=torch.bool)
    mask[idx] = True
    assert x[mask].abs().min() >= x[~mask].abs().max()
    d = codec.decode(codec.encode(x))
    assert torch.equal(d[mask], x[mask]) and (d[~mask] == 0).all()


def test_topk_selection_searches_everything_when_the_sample_misses():
    # the strided sample sees only the largest entries, so its estimate leaves fewer than k candidates
    n, k = 140_009, 1000
    x = torch.rand(n, generator=torch.Generator().manual_seed(2)) * 1e-3
    sampled = x[:: n // selection._TOPK_SAMPLE]
    sampled.copy_(torch.arange(1, sampled.numel() + 1, dtype=torch.float32))
    a = selection.magnitude_bits(x)
    assert selection._candidates(a, k) is None
    assert torch.equal(selection.topk_indices(a, k), reference_topk(x, k))


def test_topk_k_rounding_and_small_n():
    codec = make_codec("topk:0.01")
    assert [codec._count(n) for n in (0, 1, 99, 100, 101, 300)] == [0, 1, 1, 1, 2, 3]
    full = make_codec("topk:1")
    x = torch.randn(257)
    assert torch.equal(full.decode(full.encode(x)), x)


@pytest.mark.parametrize("n,k", [(1, 1), (2, 1), (7, 7), (1000, 1), (1000, 10), (1000, 999), (4096, 64), (5, 2),
                                 (1 << 33, 2), (1 << 40, 5), ((1 << 62) + 12345, 7), (1 << 24, 200_003)])
def test_elias_fano_roundtrip(n, k):
    g = torch.Generator().manual_seed((n * 31 + k) % (1 << 63))
    if n < 1 << 20:
        idx = torch.randperm(n, generator=g)[:k].sort().values
    else:  # low parts up to 60 bits wide; the largest high part too
        idx = torch.unique(torch.cat([torch.randint(0, n - 1, (k - 1,), generator=g), torch.tensor([n - 1])]))
        k = idx.numel()
    low, low_bytes, high_bytes = elias_fano.ef_layout(n, k)
    buf = torch.zeros(low_bytes + high_bytes, dtype=torch.uint8)
    elias_fano.ef_encode(idx, n, buf)
    assert torch.equal(elias_fano.ef_decode(buf, n, k), idx)
    # about 2 + log2(n/k) bits per index
    assert (low_bytes + high_bytes) * 8 <= k * (low + 2) + n / 2**low + 16


@pytest.mark.parametrize("spec", ["topk:0.01", "topk:0.1+int2", "topk:0.3+fp8", "int4"])
def test_scratch_buffers_change_no_byte(spec):
    """Temporaries taken from one Buffers across calls of different sizes (as a round's chunks
    do): the same payloads and decodes as fresh temporaries, and the results do not move when
    the buffers are reused by the next call."""
    codec = make_codec(spec)
    scratch = Buffers()
    outs = []
    for n in (140_001, 60_007, 140_001):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        payload = codec.encode(x, scratch=scratch)
        assert torch.equal(payload, codec.encode(x)), (spec, n)
        decoded = codec.decode(payload, scratch=scratch)
        assert torch.equal(decoded, codec.decode(payload)), (spec, n)
        outs.append((payload.clone(), decoded.clone(), payload, decoded))
    for kept, dec, payload, decoded in outs:
        assert torch.equal(kept, payload) and torch.equal(dec, decoded)


def test_elias_fano_rejects_corrupt_blocks():
    n, k = 10_000, 100
    idx = torch.arange(0, n, n // k)[:k]
    low, low_bytes, high_bytes = elias_fano.ef_layout(n, k)
    buf = torch.zeros(low_bytes + high_bytes, dtype=torch.uint8)
    elias_fano.ef_encode(idx, n, buf)
    extra = buf.clone()
    extra[-1] |= 0x80  # one index mark too many
    with pytest.raises(ValueError, match="corrupt top-k index block"):
        elias_fano.ef_decode(extra, n, k)
    missing = buf.clone()
    missing[low_bytes] &= 0xFE  # the first index's mark gone
    with pytest.raises(ValueError, match="corrupt top-k index block"):
        elias_fano.ef_decode(missing, n, k)
    with pytest.raises(ValueError, match=f"below n={n - 150}"):  # the last index (9900) is past n
        elias_fano.ef_decode(buf, n - 150, k)
    swapped = idx.clone()
    swapped[40], swapped[41] = idx[40] + 1, idx[40]  # same high parts, low parts decreasing
    elias_fano.ef_encode(swapped, n, buf)  # the encoder does not look at the order
    with pytest.raises(ValueError, match="not strictly increasing"):
        elias_fano.ef_decode(buf, n, k)


def test_elias_fano_is_compact_at_one_percent():
    n = 1 << 20
    k = n // 100
    _, low_bytes, high_bytes = elias_fano.ef_layout(n, k)
    bits_per_index = (low_bytes + high_bytes) * 8 / k
    assert bits_per_index < 9.0  # vs 32 for int32 indices


# ----------------------------------------------------------------------------------------------
# exact packing
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,bsz", [("int8", 128), ("int4", 128), ("int4", 4), ("int4", 12), ("int2", 128), ("int2", 36)]
)
@SETTINGS
@given(n=st.integers(0, 3000), seed=st.integers(0, 2**31 - 1), log2_scale=st.integers(-100, 100))
def test_grid_values_roundtrip_exactly(family, bsz, n, seed, log2_scale):
    """Values already on the quantization grid (q * 2**e, every block reaching +-qmax) are exact."""
    qmax = int(QMAX[family])
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-qmax, qmax + 1, (n,), generator=g)
    q[::bsz] = qmax * (torch.randint(0, 2, (len(q[::bsz]),), generator=g) * 2 - 1)  # absmax per block
    x = q.to(torch.float32) * 2.0**log2_scale
    codec = make_codec(f"{family}/{bsz}")
    payload = codec.encode(x)
    assert payload.numel() == codec.nbytes(n)
    assert torch.equal(codec.decode(payload), x)


def test_packed_layout_is_pinned():
    # int4/4: group-planar nibbles over the value stream (one partial group of width W = 6):
    # byte j = (q[j] + 8) | (q[j + 3] + 8) << 4
    codec = make_codec("int4/4")
    x = torch.tensor([1.0, -1.0, 7.0, -7.0, 3.0])
    body = codec.encode(x)[C.HEADER_BYTES :]
    scales = body[:8].view(torch.float32)
    assert scales[0].item() == 1.0
    assert scales[1].item() == pytest.approx(3.0 / 7.0)
    # q = [1, -1, 7, -7, 7, pad 0]
    assert body[8:].tolist() == [9 | 1 << 4, 7 | 15 << 4, 15 | 8 << 4]
    # int2/4: crumbs q + 1 at bits 0-1, 2-3, 4-5, 6-7 for values j, j+1, j+2, j+3 (W/4 = 1)
    codec2 = make_codec("int2/4")
    body2 = codec2.encode(torch.tensor([1.0, -1.0, 0.0, 1.0]))[C.HEADER_BYTES :]
    assert body2[4:].tolist() == [2 | 0 << 2 | 1 << 4 | 2 << 6]
    # int8: plain two's complement bytes; fp8: raw float8_e4m3fn bytes
    body8 = make_codec("int8/4").encode(torch.tensor([127.0, -127.0, 1.0, 0.0]))[C.HEADER_BYTES :]
    assert body8[4:].view(torch.int8).tolist() == [127, -127, 1, 0]
    bodyf8 = make_codec("fp8/4").encode(torch.tensor([448.0, -448.0, 1.0, 0.0]))[C.HEADER_BYTES :]
    assert bodyf8[4:].view(torch.float8_e4m3fn).float().tolist() == [448.0, -448.0, 1.0, 0.0]
    # sign/8: scales = block mean |x|; bit i of byte j = sign bit of value j + i*W/8 (W = 16: j + 2i)
    xs = torch.tensor([1.0, -2.0, -0.0, 3.0, 0.0, 4.0, -1.0, 1.0, -8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.5])
    bodys = make_codec("sign/8").encode(xs)[C.HEADER_BYTES :]
    assert bodys[:8].view(torch.float32).tolist() == [12.0 / 8, 8.5 / 8]
    negative = torch.signbit(xs).to(torch.int64)
    assert bodys[8:].tolist() == [sum(int(negative[j + 2 * i]) << i for i in range(8)) for j in range(2)]
    assert bodys[8:].tolist() == [0b00011010, 0b10000001]


def test_fp8_decode_matches_builtin_cast_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]  # 0x7F / 0xFF are NaN in e4m3fn
    codec = make_codec("fp8/4")
    m = finite.numel()
    nblocks = -(-m // 4)
    body = torch.cat([torch.ones(nblocks, dtype=torch.float32).view(torch.uint8), finite])
    out = torch.empty(m)
    codec._decode_values(body, m, out)  # scale 1: the decoded values are the fp8 values
    expected = finite.view(torch.float8_e4m3fn).float()
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))  # incl. -0.0, subnormals


def test_header_layout_is_pinned():
    codec = make_codec("int4/64")
    x = torch.randn(1000)
    payload = codec.encode(x)
    raw = bytes(payload[: C.HEADER_BYTES].numpy())
    magic, version, codec_id, kind, block, n, k, crc = struct.unpack("<4sHBBIQQI", raw)
    assert (magic, version, codec_id, kind, block, n, k) == (b"LIQ1", C.FORMAT_VERSION, 5, 0, 64, 1000, 1000)
    assert crc == zlib.crc32(bytes(payload.numpy())[C.HEADER_BYTES :], zlib.crc32(raw[:28]))


# ----------------------------------------------------------------------------------------------
# payload size formula
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_nbytes_matches_payload(spec):
    codec = make_codec(spec)
    for n in [0, 1, 2, 3, 4, 5, 63, 64, 65, 127, 128, 129, 1000, 2047, 3001]:
        x = torch.randn(n)
        assert codec.encode(x).numel() == codec.nbytes(n), (spec, n)


def test_nbytes_formulas():
    h = C.HEADER_BYTES
    n = 1000
    assert make_codec("fp32").nbytes(n) == h + 4000
    assert make_codec("bf16").nbytes(n) == h + 2000
    assert make_codec("fp8").nbytes(n) == h + 4 * 8 + 1000
    assert make_codec("int8").nbytes(n) == h + 4 * 8 + 1000
    assert make_codec("int4").nbytes(n) == h + 4 * 8 + 500
    assert make_codec("int4").nbytes(1001) == h + 4 * 8 + 501
    assert make_codec("int2").nbytes(n) == h + 4 * 8 + 250
    assert make_codec("int2/64").nbytes(1001) == h + 4 * 16 + 251
    assert make_codec("sign").nbytes(n) == h + 4 * 8 + 125
    assert make_codec("sign/64").nbytes(1001) == h + 4 * 16 + 126
    assert make_codec("int4").nbytes(0) == h
    # top-k: k = ceil(f n) values + Elias-Fano indices
    k = 10
    low = (n // k).bit_length() - 1
    ef = -(-k * low // 8) + -(-(k + ((n - 1) >> low) + 1) // 8)
    assert make_codec("topk:0.01").nbytes(n) == h + 4 * k + ef
    assert make_codec("topk:0.01+int4").nbytes(n) == h + 4 + 5 + ef


def test_compression_is_real():
    n = 1 << 16
    assert compression_ratio(n, make_codec("int4").nbytes(n)) > 7.5
    assert compression_ratio(n, make_codec("int2").nbytes(n)) > 14
    assert compression_ratio(n, make_codec("topk:0.01+int4").nbytes(n)) > 150


# ----------------------------------------------------------------------------------------------
# validation: tampering, truncation, wrong codec, non-finite input
# ----------------------------------------------------------------------------------------------


def test_wrong_codec_rejected_with_clear_message():
    x = torch.randn(500)
    p4 = make_codec("int4").encode(x)
    with pytest.raises(ValueError, match=r"codec mismatch.*'int4/128'.*'int8/128'"):
        make_codec("int8").decode(p4)
    with pytest.raises(ValueError, match=r"codec mismatch.*'int4/128'.*'int4/64'"):
        make_codec("int4/64").decode(p4)
    with pytest.raises(ValueError, match="codec mismatch"):
        make_codec("topk:0.01+int4").decode(p4)
    pk = make_codec("topk:0.01+int4").encode(x)
    with pytest.raises(ValueError, match=r"k=5 values .* k=25"):
        make_codec("topk:0.05+int4").decode(pk)
    with pytest.raises(ValueError, match="codec mismatch"):
        make_codec("fp32").decode(make_codec("bf16").encode(x))


def test_truncated_and_padded_payloads_rejected():
    codec = make_codec("int4")
    p = codec.encode(torch.randn(999))
    with pytest.raises(ValueError, match=r"truncated: \d+ bytes, expected \d+"):
        codec.decode(p[:-1])
    with pytest.raises(ValueError, match="shorter than the 32-byte header"):
        codec.decode(p[:10])
    with pytest.raises(ValueError, match="trailing bytes"):
        codec.decode(torch.cat([p, torch.zeros(1, dtype=torch.uint8)]))
    with pytest.raises(ValueError, match="1-D uint8"):
        codec.decode(p.view(torch.int8))


def test_magic_and_version_rejected():
    codec = make_codec("int8")
    p = codec.encode(torch.randn(10))
    bad = p.clone()
    bad[0] = ord("X")
    with pytest.raises(ValueError, match="magic"):
        codec.decode(bad)
    bad = p.clone()
    bad[4] = C.FORMAT_VERSION + 1
    with pytest.raises(ValueError, match=r"version 2, but this build reads version 1"):
        codec.decode(bad)


@pytest.mark.parametrize("spec", ["int4/16", "topk:0.2+int2/8", "bf16", "fp8/8"])
def test_every_single_bit_flip_is_detected(spec):
    codec = make_codec(spec)
    p = codec.encode(torch.randn(37, generator=torch.Generator().manual_seed(0)))
    for pos in range(p.numel()):
        for bit in (0, 3, 7):
            bad = p.clone()
            bad[pos] ^= 1 << bit
            with pytest.raises(ValueError):
                codec.decode(bad)


def test_body_corruption_message():
    codec = make_codec("int8")
    p = codec.encode(torch.randn(300))
    p[100] ^= 0x10
    with pytest.raises(ValueError, match=r"checksum mismatch: header says crc32=0x[0-9a-f]{8}.*corrupted"):
        codec.decode(p)


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_input_refused(spec, bad):
    codec = make_codec(spec)
    x = torch.randn(1000)
    x[[3, 500, 999]] = bad
    with pytest.raises(ValueError, match=r"3 non-finite values .*diverged.*learning rate"):
        codec.encode(x)


def test_input_type_checks():
    codec = make_codec("int4")
    with pytest.raises(TypeError, match="float32"):
        codec.encode(torch.randn(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="1-D"):
        codec.encode(torch.randn(2, 5))
    x = torch.randn(20, 2)[:, 0]  # non-contiguous is accepted
    assert torch.equal(codec.decode(codec.encode(x)), codec.decode(codec.encode(x.contiguous())))


# ----------------------------------------------------------------------------------------------
# special values
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["fp8", "int8", "int4", "int2", "bf16", "topk:0.5+int4"])
def test_zeros_and_constant_blocks(spec):
    codec = make_codec(spec)
    z = torch.zeros(300)
    for n in (300, 5000):  # 5000: a full slab as well as a tail
        z = torch.zeros(n)
        d = codec.decode(codec.encode(z))
        assert (d.view(torch.int32) == 0).all()  # +0.0 exactly: no NaN, no -0.0
    c = torch.full((300,), -3.25)
    d = codec.decode(codec.encode(c))
    if not spec.startswith("topk"):
        assert torch.allclose(d, c, rtol=1e-6, atol=0)


@pytest.mark.parametrize("spec", ["fp8", "int8", "int4", "int2", "bf16", "fp32", "sign"])
def test_extreme_magnitudes_stay_finite(spec):
    fmax = torch.finfo(torch.float32).max
    tiny = torch.finfo(torch.float32).tiny
    x = torch.tensor([fmax, -fmax, fmax / 3, tiny, -tiny, 1e-45, 0.0, 1.0] * 40 + [fmax] * 128 + [1e-45, -1e-45] * 64)
    codec = make_codec(spec)
    d = codec.decode(codec.encode(x))
    assert torch.isfinite(d).all()
    if spec == "bf16":  # beyond the bf16 range: clamped to its largest value
        assert d[0].item() == torch.finfo(torch.bfloat16).max
    else:
        assert_within_bound(codec, x, d)


# ----------------------------------------------------------------------------------------------
# determinism
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_deterministic_bytes_and_decode(spec):
    codec = make_codec(spec)
    x = make_vector(5000, 7, 0.0, "heavy_tail")
    p1, p2 = codec.encode(x), codec.encode(x.clone())
    assert torch.equal(p1, p2)
    d1, d2 = codec.decode(p1), codec.decode(p2.clone())
    assert torch.equal(d1, d2)
    out = torch.full_like(x, float("nan"))
    assert codec.decode(p1, out=out) is out and torch.equal(out, d1)


@pytest.mark.parametrize("spec", ["int4", "fp8/32", "bf16", "topk:0.1+int2"])
def test_misaligned_and_strided_payloads_decode(spec):
    codec = make_codec(spec)
    x = make_vector(1001, 2, 0.0, "gauss")
    p = codec.encode(x)
    ref = codec.decode(p)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), p])[1:]  # storage offset 1
    strided = torch.stack([p, p], dim=1)[:, 0]
    assert torch.equal(codec.decode(shifted), ref)
    assert torch.equal(codec.decode(strided), ref)


def test_thread_count_and_slab_size_do_not_change_results(monkeypatch):
    x = make_vector(50_001, 3, 2.0, "gauss")
    threads = torch.get_num_threads()
    for spec in ["int4", "int2/64", "fp8", "int8", "sign/96", "topk:0.01+int4"]:
        codec = make_codec(spec)
        ref_p = codec.encode(x)
        ref_d = codec.decode(ref_p)
        try:
            torch.set_num_threads(1)
            assert torch.equal(codec.encode(x), ref_p)
            assert torch.equal(codec.decode(ref_p), ref_d)
        finally:
            torch.set_num_threads(threads)
        for slab in (1 << 12, 1 << 30):  # many small slabs; one slab (the path non-CPU devices take)
            monkeypatch.setattr(blockwise, "_CPU_SLAB_ELEMS", slab)
            assert torch.equal(codec.encode(x), ref_p)
            assert torch.equal(codec.decode(ref_p), ref_d)
            monkeypatch.undo()


# ----------------------------------------------------------------------------------------------
# Triton kernels == torch reference, bit for bit (under LI_TRITON=interpret, or on CUDA below)
# ----------------------------------------------------------------------------------------------

# the codecs that have Triton kernels (the blockwise ones, sign excepted), at block sizes below, at and
# above a packing group, powers of two and not, alone and inside top-k (each costs its first-use probe
# under the interpreter)
TRITON_SPECS = ["fp8", "int8", "int4", "int2", "int2/4", "int8/12", "fp8/36", "int4/4096", "int2/6000",
                "topk:0.3+int2/16", "topk:0.9+fp8"]
_NO_TRITON = "no fast path on CPU: runs under LI_TRITON=interpret (tests/test_triton_kernels.py)"


def _both_paths(codec: C.Codec, x: torch.Tensor) -> None:
    fast_p = codec.encode(x)
    fast_d = codec.decode(fast_p)
    with torch_path():
        ref_p = codec.encode(x)
        ref_d = codec.decode(ref_p)
        cross_d = codec.decode(fast_p)
    assert torch.equal(fast_p, ref_p), f"{codec.name}: {int((fast_p != ref_p).sum())} bytes differ"
    assert torch.equal(fast_d.view(torch.int32), ref_d.view(torch.int32))
    assert torch.equal(cross_d.view(torch.int32), fast_d.view(torch.int32))


@pytest.mark.skipif(not TRITON, reason=_NO_TRITON)
@pytest.mark.parametrize("spec", TRITON_SPECS)
@settings(max_examples=6, deadline=None, suppress_health_check=_SUPPRESS)
@given(x=vectors(max_len=5000))
def test_triton_kernels_match_torch_reference_bitwise(spec, x):
    _both_paths(make_codec(spec), x)


@pytest.mark.skipif(not TRITON, reason=_NO_TRITON)
@pytest.mark.parametrize("spec", TRITON_SPECS)
def test_triton_kernels_match_torch_on_edge_values(spec):
    fmax, tiny = torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny
    g = torch.Generator().manual_seed(5)
    cases = [
        torch.randn(10_001, generator=g),  # several packing groups, a partial block and packing group
        torch.randn(5000, generator=g) * 1e-40,  # fp32 subnormals
        torch.randn(5000, generator=g) * 1e37,
        torch.tensor([fmax, -fmax, fmax / 3, tiny, -tiny, 1e-45, -0.0, 0.0, 1.0] * 500),
        torch.arange(-4096, 4096, dtype=torch.float32) / 8,  # exact ties at every quantization step
        torch.zeros(5000),
    ]
    codec = make_codec(spec)
    for x in cases:
        _both_paths(codec, x)


def test_topk_selection_ignores_the_flush_to_zero_mode():
    # subnormal magnitudes rank above zeros, whatever the CPU's denormal mode
    x = torch.zeros(1000)
    x[500:] = torch.arange(1, 501).float() * 1e-45
    x[0] = 1.0
    codec = make_codec("topk:0.01")
    expected = make_codec("topk:0.01").encode(x)
    assert torch.set_flush_denormal(True)
    try:
        got = codec.encode(x)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(got, expected)
    idx = elias_fano.ef_decode(got[C.HEADER_BYTES + 4 * 10 :], 1000, 10)
    assert idx.tolist() == [0, *range(991, 1000)]


def test_decode_is_q_times_scale_with_one_rounding():
    codec = make_codec("int8/64")
    x = make_vector(1000, 11, -3.0, "gauss")
    body = codec.encode(x)[C.HEADER_BYTES :]
    scales = body[: 4 * 16].view(torch.float32)
    q = body[4 * 16 :].view(torch.int8)
    expected = q.float() * scales.repeat_interleave(64)[:1000]
    assert torch.equal(codec.decode(codec.encode(x)), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_cuda_decode_matches_cpu_bitwise(spec):
    codec = make_codec(spec)
    x = make_vector(300_001, 5, 0.0, "heavy_tail")
    p_cpu = codec.encode(x)
    d_cpu = codec.decode(p_cpu)
    d_cuda = codec.decode(p_cpu.cuda())
    assert d_cuda.is_cuda and torch.equal(d_cuda.cpu(), d_cpu)
    p_cuda = codec.encode(x.cuda())
    assert p_cuda.is_cuda and torch.equal(p_cuda.cpu(), p_cpu)  # one wire format on every device
    assert torch.equal(codec.decode(p_cuda.cpu()), codec.decode(p_cuda).cpu())
    if not spec.startswith("topk"):
        assert_within_bound(codec, x, codec.decode(p_cuda).cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_error_feedback_state_of_a_gpu_residual_loads_anywhere():
    ef = ErrorFeedback()
    x = torch.randn(1000, device="cuda")
    ef.update(x, torch.zeros_like(x))
    state = ef.state_dict()
    assert state["residual"].device.type == "cpu" and torch.equal(state["residual"], x.cpu())
    restored = ErrorFeedback()
    restored.load_state_dict(state)
    assert torch.equal(restored.compensate(torch.zeros_like(x)).cpu(), x.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_payload_checksums_are_taken_on_the_gpu():
    pytest.importorskip("triton", reason="the CUDA build of torch brings triton")
    from lightning_islands.codecs import triton_crc

    g = torch.Generator().manual_seed(9)
    for n in [1, 1023, 1025, 262_145, (3 << 20) + 7]:
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert crc32.from_raw(0, triton_crc.raw_crc(data.cuda()), n) == zlib.crc32(data.numpy().tobytes()), n
    codec = make_codec("fp32")
    x = make_vector(1_000_003, 3, 0.0, "gauss")
    payload = codec.encode(x.cuda())
    assert checksum.CRC_KERNEL_TRUSTED.get(str(payload.device)) is True, "the GPU CRC kernel failed its check"
    assert torch.equal(payload.cpu(), codec.encode(x))
    assert torch.equal(codec.decode(payload).cpu(), x)
    payload[-1] ^= 1  # a corrupted CUDA payload is still refused
    with pytest.raises(ValueError, match="checksum mismatch"):
        codec.decode(payload)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", ["fp8", "int8", "int4", "int2", "int4/96", "int2/4096", "fp8/36"])
def test_cuda_runs_the_triton_kernels_and_they_pass_their_check(spec):
    pytest.importorskip("triton", reason="the CUDA build of torch brings triton")
    codec = make_codec(spec)
    x = make_vector(1_000_003, 7, 0.0, "mixed_magnitudes").cuda()
    payload = codec.encode(x)
    decoded = codec.decode(payload)
    assert blockwise.TRITON_TRUSTED[(str(x.device), codec.name)], "the Triton kernels fell back to the torch path"
    with torch_path():
        assert torch.equal(payload, codec.encode(x))
        reference = codec.decode(payload.cpu())
    assert torch.equal(decoded.cpu().view(torch.int32), reference.view(torch.int32))


# ----------------------------------------------------------------------------------------------
# error feedback
# ----------------------------------------------------------------------------------------------


def _run_rounds(codec: C.Codec, rounds: int, ef: ErrorFeedback | None) -> tuple[list[float], float]:
    g = torch.Generator().manual_seed(0)
    n = 4096
    bias = torch.randn(n, generator=g) * 0.3  # systematic component int2 mostly rounds to zero
    true_sum = torch.zeros(n, dtype=torch.float64)
    sent_sum = torch.zeros(n, dtype=torch.float64)
    errors = []
    one_round = 0.0
    for _ in range(rounds):
        delta = bias + torch.randn(n, generator=g)
        c = ef.compensate(delta) if ef is not None else delta
        dec = codec.decode(codec.encode(c))
        if ef is not None:
            ef.update(c, dec)
        err = delta - codec.decode(codec.encode(delta))
        one_round = max(one_round, float(torch.linalg.vector_norm(err)))
        true_sum += delta.double()
        sent_sum += dec.double()
        errors.append(float(torch.linalg.vector_norm(true_sum - sent_sum)))
    return errors, one_round


@pytest.mark.parametrize("spec", ["int2", "sign"])
def test_error_feedback_keeps_running_sum_on_track(spec):
    codec = make_codec(spec)
    with_ef, one_round = _run_rounds(codec, 150, ErrorFeedback())
    without_ef, _ = _run_rounds(codec, 150, None)
    # with feedback the accumulated error is just the current residual: about one round's error
    # (a bit more, since the compensated vector is larger than the raw delta)
    assert max(with_ef) <= 2 * one_round
    # without feedback the systematic part that int2 rounds away accumulates linearly
    assert without_ef[-1] > 10 * one_round
    assert without_ef[-1] > 8 * max(with_ef)
    assert without_ef[-1] > 2 * without_ef[len(without_ef) // 4]


def test_error_feedback_state_roundtrip_and_reset():
    ef = ErrorFeedback()
    x = torch.randn(100)
    assert ef.compensate(x) is x  # no residual yet
    codec = make_codec("int4")
    dec = codec.decode(codec.encode(x))
    ef.update(x, dec)
    assert torch.equal(ef.residual, x - dec)
    state = ef.state_dict()
    ef2 = ErrorFeedback()
    ef2.load_state_dict(state)
    assert torch.equal(ef2.compensate(x), x + (x - dec))
    state["residual"].zero_()  # state_dict is a copy
    assert not torch.equal(ef.residual, state["residual"])
    ef.update(x, dec)  # in-place reuse of the residual buffer
    assert torch.equal(ef.residual, x - dec)
    with pytest.raises(ValueError, match="reset"):
        ef.compensate(torch.randn(5))
    ef.reset()
    assert ef.residual is None and ef.state_dict() == {"residual": None}
    ef.load_state_dict({"residual": None})
    with pytest.raises(ValueError):
        ef.load_state_dict({})


@pytest.mark.parametrize("spec", ["fp32", "bf16", "fp8", "int8/96", "int4/100", "int2", "sign/64", "topk:0.1+int4/96"])
def test_pieces_at_the_alignment_decode_to_what_the_whole_vector_does(spec):
    # the islands' chunked exchange cuts its vector at multiples of the codec's alignment
    codec = make_codec(spec)
    g = torch.Generator().manual_seed(9)
    n = 3 * codec.alignment + 777
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n)
    whole = codec.decode(codec.encode(x))
    bounds = [0, codec.alignment, 3 * codec.alignment, n]
    pieces = torch.cat([codec.decode(codec.encode(x[a:b])) for a, b in zip(bounds, bounds[1:])])
    if spec.startswith("topk"):  # it keeps its fraction of each piece
        assert codec.alignment == make_codec("int4/96").alignment
        return
    assert torch.equal(pieces, whole)
    if codec.alignment > 1:  # and a cut inside a block (or packing group) changes what is sent
        cut = codec.alignment // 2 + 1
        shifted = torch.cat([codec.decode(codec.encode(x[:cut])), codec.decode(codec.encode(x[cut:]))])
        assert not torch.equal(shifted, whole)


def test_with_residual_adds_the_decayed_residual():
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    assert torch.equal(C.with_residual(x, r), x + r)  # decay 1: plain error feedback, bit for bit
    assert torch.equal(C.with_residual(x, r, 0.0), x)
    for decay in (1.0, 0.8, 0.0):  # in place: the same bits
        assert torch.equal(C.add_residual_(x.clone(), r, decay), C.with_residual(x, r, decay))
    torch.testing.assert_close(C.with_residual(x, r, 0.25), x + r / 4, rtol=0, atol=1e-6)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"decay must be in \[0, 1\]"):
            C.check_decay(bad)
        with pytest.raises(ValueError, match=r"decay must be in \[0, 1\]"):
            ErrorFeedback(decay=bad)


def test_a_decayed_residual_fades_round_by_round():
    # a codec that sends nothing: everything stays in the residual, and what was held back k rounds
    # ago reaches the next round scaled by decay ** k
    ef = ErrorFeedback(decay=0.5)
    first = torch.tensor([8.0, -4.0])
    nothing = torch.zeros(2)
    c = ef.compensate(first)
    ef.update(c, nothing)
    for k in range(1, 4):
        c = ef.compensate(torch.zeros(2))
        assert torch.equal(c, first * 0.5 ** k)
        ef.update(c, nothing)
    plain = ErrorFeedback()
    plain.update(first, nothing)
    assert torch.equal(plain.compensate(torch.zeros(2)), first)  # without decay it never fades


def test_default_error_feedback():
    for spec in ["int4", "int2", "int4/64", "sign", "topk:0.01", "topk:0.01+int4", "topk:0.1+int8"]:
        assert default_error_feedback(spec) is True, spec
    for spec in ["fp32", "bf16", "fp8", "int8", "int8/64"]:
        assert default_error_feedback(spec) is False, spec


# ----------------------------------------------------------------------------------------------
# factory, metrics, checksum helper
# ----------------------------------------------------------------------------------------------


def test_make_codec_parsing():
    assert make_codec("int4").block_size == 128
    assert make_codec("int4", block_size=64).name == "int4/64"
    assert make_codec(" INT4/32 ").name == "int4/32"
    assert make_codec("int4/32", block_size=64).block_size == 32  # the spec wins
    assert make_codec("fp32", block_size=64).name == "fp32"
    assert make_codec("topk:0.01").name == "topk:0.01"
    assert make_codec("topk:1e-3+int4/64").name == "topk:0.001+int4/64"
    for spec in ALL_SPECS:
        codec = make_codec(spec)
        assert make_codec(codec.name) == codec
        s = codec.spec()
        assert {"codec", "block_size", "k_fraction", "format_version"} <= set(s)
        assert s["codec"] == codec.name and s["format_version"] == C.FORMAT_VERSION
    assert make_codec("topk:0.05+int4").spec()["k_fraction"] == "0.05"
    assert make_codec("topk:0.05+int4").spec()["index_encoding"] == "elias-fano"
    for bad in ["", "int3", "int4/6", "int4/0", "int4/x", "topk:0", "topk:1.5", "topk:abc", "topk:1/3",
                "topk:0.1+topk:0.2", "fp16", "topk:0.1+int5"]:  # fmt: skip
        with pytest.raises(ValueError):
            make_codec(bad)


def test_metrics():
    x = torch.tensor([3.0, 4.0])
    assert quantization_error(x, x) == 0.0
    assert quantization_error(x, torch.zeros(2)) == pytest.approx(1.0)
    assert quantization_error(torch.zeros(3), torch.zeros(3)) == 0.0
    assert compression_ratio(1000, 500) == 8.0
    with pytest.raises(ValueError):
        compression_ratio(10, 0)


@SETTINGS
@given(data=st.binary(max_size=4000), cut=st.integers(0, 4000), start=st.integers(0, 2**32 - 1))
def test_crc32_combine_matches_zlib(data, cut, start):
    a, b = data[: cut % (len(data) + 1)], data[cut % (len(data) + 1) :]
    for combine in (crc32.crc32_combine, crc32.crc32_combine_py):  # zlib-ng's C function, and the Python one
        assert combine(zlib.crc32(a, start), zlib.crc32(b), len(b)) == zlib.crc32(data, start)


@SETTINGS
@given(crc_a=st.integers(0, 2**32 - 1), crc_b=st.integers(0, 2**32 - 1), len_b=st.integers(0, 2**62))
def test_crc32_combine_c_and_python_agree_at_any_length(crc_a, crc_b, len_b):
    """Lengths no test message has (chunks of many GiB): the C and Python joins still agree."""
    assert crc32.crc32_combine(crc_a, crc_b, len_b) == crc32.crc32_combine_py(crc_a, crc_b, len_b)
    with pytest.raises(ValueError, match="len_b must be >= 0"):
        crc32.crc32_combine(crc_a, crc_b, -1 - len_b)


@SETTINGS
@given(data=st.binary(max_size=3000), start=st.integers(0, 2**32 - 1))
def test_crc32_from_raw_matches_zlib(data, start):
    raw = 0  # the raw CRC, bit by bit: register from 0, no final xor
    for byte in data:
        raw ^= byte
        for _ in range(8):
            raw = (raw >> 1) ^ crc32.POLY_REFLECTED if raw & 1 else raw >> 1
    assert crc32.from_raw(start, raw, len(data)) == zlib.crc32(data, start)


@pytest.mark.parametrize("bits, group, step, tail",
                         [(8, 16, 1, 1), (8, 1024, 1, 1), (32, 4, 16, 0), (32, 256, 4096, 0)])
def test_crc32_weight_tables_fold_groups_into_their_raw_crc(bits, group, step, tail):
    """Folding a group with :func:`crc32.weight_table` (what the GPU kernel does) gives the raw CRC of
    the bytes it stands for: bytes directly, raw CRCs of ``step``-byte pieces one level up."""
    rng = np.random.default_rng(group)
    table = crc32.weight_table(bits, group, step, tail)
    pieces = [rng.integers(0, 256, step, dtype=np.uint8).tobytes() for _ in range(group)]
    values = [p[0] for p in pieces] if bits == 8 else [_raw(p) for p in pieces]
    folded = 0
    for i, v in enumerate(values):
        for b in range(bits):
            if v >> b & 1:
                folded ^= table[b][i]
    assert folded == _raw(b"".join(pieces))


def _raw(data: bytes) -> int:
    """Raw CRC-32 of ``data`` from zlib's: :func:`crc32.from_raw` solved for the raw part."""
    return zlib.crc32(data) ^ crc32.from_raw(0, 0, len(data))


@pytest.mark.parametrize("fault", ["wrong", "raises"])
def test_a_gpu_crc_kernel_that_disagrees_with_zlib_is_not_used(monkeypatch, fault):
    def raw_crc(body):
        if fault == "raises":
            raise RuntimeError("PassManager::run failed")
        return 1

    monkeypatch.setattr(checksum, "CRC_KERNEL_TRUSTED", {})
    kernel = types.SimpleNamespace(raw_crc=raw_crc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert checksum.crc_kernel_trusted(kernel, torch.device("cpu")) is False
        assert checksum.crc_kernel_trusted(kernel, torch.device("cpu")) is False
    said = [str(w.message) for w in caught if "the GPU CRC-32 kernel on cpu failed its check" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]  # said once
    assert ("where zlib gives" if fault == "wrong" else "PassManager") in said[0], said
    assert "taken on the host" in said[0], said


def test_parallel_crc_equals_zlib():
    body = torch.randint(0, 256, ((9 << 20) + 12345,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    prefix = b"0123456789abcdefghijklmnopqr"
    assert checksum.crc32_of(prefix, body) == zlib.crc32(np.asarray(body.numpy()).tobytes(), zlib.crc32(prefix))
