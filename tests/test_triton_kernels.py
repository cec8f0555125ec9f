"""The GPU codec kernels (lightning_islands/triton_kernels.py), checked on the CPU.

Triton's interpreter runs the same kernel source on CPU tensors when ``TRITON_INTERPRET=1`` is set
before triton is imported, so every check here runs in a fresh Python process with
``LI_TRITON=interpret``, which routes the blockwise codecs' CPU tensors to the Triton kernels. What
the interpreter cannot show is how a GPU compiler rounds. Two checks stand in for it: the kernels are
compiled here to PTX for three GPU generations and their arithmetic is read (no contraction, no
approximation, no flushing), and on a GPU each codec compares the kernels with the torch path on a
probe before first use (tests/test_codec_probe.py shows that the probe catches each rounding fault;
the tests below show what happens when the comparison fails).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (it is on Linux x86_64, with the test extra)")

# What the codecs say when a Triton kernel fails its check or triton is missing: an error here, so a
# run that silently fell back to the torch path cannot pass as a run of the kernels.
_NO_FALLBACK = ["-W", "error:lightning_islands. the Triton kernels", "-W", "error:lightning_islands. triton is not"]


def _interpreted(args: list[str], timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "TRITON_INTERPRET": "1", "LI_TRITON": "interpret", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return _interpreted([*_NO_FALLBACK, "-c", code], **env)


@pytest.mark.slow
def test_codec_suite_passes_on_the_triton_kernels():
    """The codec tests that pin bytes and bounds (fused path vs torch reference bit for bit,
    hypothesis-generated vectors, ties, subnormals, extreme magnitudes, the pinned packed layout,
    non-finite input, corruption) run against the Triton kernels."""
    selection = ("fused_kernels_match or grid_values or packed_layout or every_single_bit or nonfinite or "
                 "zeros_and_constant or extreme or decode_is_q_times or dense_roundtrip or deterministic")
    proc = _interpreted(["-m", "pytest", "tests/test_codecs.py", "-q", "-p", "no:cacheprovider", "-x",
                         "-W", "ignore::RuntimeWarning", *_NO_FALLBACK, "-k", selection])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]


def test_the_blockwise_codecs_run_the_triton_kernels_and_trust_them():
    code = """
import torch
from lightning_islands import codecs as C, native, triton_kernels
from lightning_islands.codecs import blockwise
calls = []
real = triton_kernels.encode_blockwise
triton_kernels.encode_blockwise = lambda *a: (calls.append(a[4]), real(*a))[1]
x = torch.randn(70_001, generator=torch.Generator().manual_seed(1))
for spec in ["int8", "int4/96", "int2/4096", "fp8/36"]:
    codec = C.make_codec(spec)
    payload = codec.encode(x)
    with native.disabled():
        assert torch.equal(payload, codec.encode(x)), spec
        ref = codec.decode(payload)
    assert torch.equal(codec.decode(payload).view(torch.int32), ref.view(torch.int32)), spec
print("bits", calls)
print("trusted", sorted(blockwise.TRITON_TRUSTED.items()))
"""
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # each codec: the two probes of its first-use check (whole, and cut short), then the real encode
    assert "bits [8, 8, 8, 4, 4, 4, 2, 2, 2, 8, 8, 8]" in proc.stdout, proc.stdout
    assert ("trusted [(('cpu', 'fp8/36'), True), (('cpu', 'int2/4096'), True), (('cpu', 'int4/96'), True), "
            "(('cpu', 'int8/128'), True)]") in proc.stdout, proc.stdout


@pytest.mark.parametrize("fault", ["encode_bit", "decode_bit", "no_compile"])
def test_a_kernel_that_disagrees_with_the_reference_is_not_used(fault):
    """The first-use check compares a probe's bytes and decoded bits with the torch path; a kernel
    that differs in one bit (or does not compile) is dropped with a warning, and the payload stays
    the reference one. (Which faults the probe reveals: tests/test_codec_probe.py.)"""
    code = f"""
import warnings
import torch
from lightning_islands import codecs as C, native, triton_kernels
from lightning_islands.codecs import blockwise
fault = {fault!r}
enc, dec = triton_kernels.encode_blockwise, triton_kernels.decode_blockwise
def bad_encode(x, scales, values, *rest):
    if fault == "no_compile":
        raise RuntimeError("PassManager::run failed")
    enc(x, scales, values, *rest)
    if fault == "encode_bit":
        values[x.numel() // 3 // 2] ^= 1
def bad_decode(values, scales, out, *rest):
    dec(values, scales, out, *rest)
    if fault == "decode_bit":
        out[-1] = torch.nextafter(out[-1], torch.tensor(1e30))
triton_kernels.encode_blockwise, triton_kernels.decode_blockwise = bad_encode, bad_decode
codec = C.make_codec("int4")
x = torch.randn(9000, generator=torch.Generator().manual_seed(3))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    payload = codec.encode(x)
    decoded = codec.decode(payload)
with native.disabled():
    assert torch.equal(payload, codec.encode(x))
    assert torch.equal(decoded, codec.decode(payload))
print("trusted", blockwise.TRITON_TRUSTED)
print("warned", [str(w.message) for w in caught])
"""
    proc = _interpreted(["-c", code])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trusted {('cpu', 'int4/128'): False}" in proc.stdout, proc.stdout
    expected = {"encode_bit": "encode of", "decode_bit": "decode of", "no_compile": "PassManager"}[fault]
    assert "the Triton kernels of codec 'int4/128' on cpu failed their check" in proc.stdout, proc.stdout
    assert expected in proc.stdout and "uses the slower torch path" in proc.stdout, proc.stdout


@pytest.mark.parametrize("one_pass", ["1", "0"])
def test_the_one_pass_encoder_gives_the_reference_bytes(one_pass):
    """Whole units (power-of-two blocks up to 16384 values, with a packing group or several per
    unit, or several blocks per group) go through the one-pass encoder, the rest through the
    two-pass one; on each codec's probe (ties, rounded ties, subnormal and near-overflow blocks),
    whole and cut short, both give the torch path's bytes. A NaN or an Inf in a block shows in
    that block's scale (the codec then refuses the input). ``LI_TRITON_ONE_PASS=0`` keeps every
    value on the two-pass encoder."""
    code = """
import math, torch
from lightning_islands import codec_probe, native, triton_kernels as tk
from lightning_islands.codecs import PACK_GROUP, make_codec
launched = []
real = tk.kernels()
class Spy:
    def __init__(self, name):
        self.name = name
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            launched.append(self.name)
            return getattr(real, self.name)[grid](*args, **kwargs)
        return launch
spy = type("K", (), {n: Spy(n) for n in ("scales", "encode", "units", "decode")})()
tk.kernels = lambda: spy
for spec in ["int8/64", "int4", "int2/2048", "fp8/4096", "int4/16384", "int2/96", "int8/32768"]:
    codec = make_codec(spec)
    bits, block = int(codec.bits), codec.block_size
    whole = codec_probe.probe(block, codec.qmax, codec.fp8)
    for x in (whole, whole[: whole.numel() - 5]):
        n = x.numel()
        nb = -(-n // block)
        scales = torch.empty(nb)
        values = torch.empty(-(-n // codec.pack), dtype=torch.uint8)
        launched.clear()
        tk.encode_blockwise(x, scales, values, block, bits, codec.fp8, codec.qmax, PACK_GROUP)
        ref = torch.zeros(4 * nb + values.numel(), dtype=torch.uint8)
        with native.disabled():
            codec._torch_encode(x, *codec._body_parts(ref, n))
        assert torch.equal(scales.view(torch.uint8), ref[: 4 * nb]), spec
        assert torch.equal(values, ref[4 * nb :]), spec
        print(codec.name, n, tk.one_pass_unit(block, PACK_GROUP), sorted(set(launched)))
    bad = torch.randn(5 * max(block, 16384))
    bad[3 * block + 1], bad[2 * block + 7] = float("nan"), float("-inf")
    scales = torch.empty(-(-bad.numel() // block))
    tk.encode_blockwise(bad, scales, torch.empty(-(-bad.numel() // codec.pack), dtype=torch.uint8), block, bits,
                        codec.fp8, codec.qmax, PACK_GROUP)
    assert math.isnan(scales[3]) and scales[2] == math.inf and torch.isfinite(scales[4:]).all(), spec
"""
    proc = _python(code, LI_TRITON_ONE_PASS=one_pass)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 14, proc.stdout
    for line in lines:
        spec, n, unit = line.split()[:3]
        block = int(spec.split("/")[1])
        if one_pass == "0" or block in (96, 32768):
            assert unit == "None" and "'units'" not in line, line
            continue
        assert int(unit) == max(4096, block), line
        tail = int(n) % int(unit)
        assert ("'units'" in line) == (int(n) >= int(unit)) and ("'scales'" in line) == (tail > 0), line


def test_the_gpu_crc_kernel_gives_zlibs_crc32():
    """lightning_islands/triton_crc.py: the fold tree gives zlib's CRC-32 for lengths that fill,
    straddle and miss its groups, over one to six levels (small fan-ins make deep trees cheap under
    the interpreter; the defaults run too), and the codecs' first-use check trusts it."""
    code = """
import zlib
import torch
from lightning_islands import crc32, triton_crc
from lightning_islands.codecs import checksum
g = torch.Generator().manual_seed(5)
cases = [(1, 2, 2), (2, 2, 2), (33, 2, 2), (1000, 16, 4), (4099, 16, 2), (4096, 16, 4), (257, 256, 2),
         (1023, 1024, 256), (1024 * 8 + 3, 1024, 256)]
for n, byte_group, raw_group in cases:
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    raw = triton_crc.raw_crc(data, byte_group, raw_group)
    for start in (0, 0xFFFFFFFF, 0x5EED):
        got = crc32.from_raw(start, raw, n)
        assert got == zlib.crc32(data.numpy().tobytes(), start), (n, byte_group, raw_group, start)
assert triton_crc.raw_crc(torch.empty(0, dtype=torch.uint8)) == 0
for bad in ((data.view(torch.int8),), (data, 3, 2), (data, 1024, 1)):
    try:
        triton_crc.raw_crc(*bad)
    except ValueError as e:
        print("refused:", e)
checksum.CRC_PROBE_BYTES = 3000  # the real probe takes minutes under the interpreter
print("trusted", checksum.crc_kernel_trusted(triton_crc, torch.device("cpu")))
"""
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("refused:") == 3, proc.stdout
    assert "trusted True" in proc.stdout, proc.stdout


def test_interpret_mode_without_the_interpreter_is_a_clear_error():
    code = "import torch; from lightning_islands.codecs import make_codec; make_codec('int4').encode(torch.ones(8))"
    proc = _interpreted(["-c", code], TRITON_INTERPRET="0")
    assert proc.returncode != 0
    assert "LI_TRITON=interpret" in proc.stderr and "TRITON_INTERPRET=1" in proc.stderr, proc.stderr[-2000:]


def test_li_triton_0_keeps_the_kernels_off():
    code = ("import torch; from lightning_islands import codecs as C; from lightning_islands.codecs import blockwise;"
            "C.make_codec('int4').encode(torch.ones(8)); print('trusted', blockwise.TRITON_TRUSTED)")
    proc = _interpreted(["-c", code], LI_TRITON="0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "trusted {}" in proc.stdout, proc.stdout


# (bits, fp8) of fp8, int8, int4 and int2
_VARIANTS = [(8, True), (8, False), (4, False), (2, False)]


@pytest.mark.parametrize("arch", [80, 90, 100])
def test_the_kernels_compile_for_gpus_with_every_rounding_as_written(arch):
    """Compiled for Ampere, Hopper and Blackwell without a GPU (Triton ships its own LLVM and
    ptxas): the PTX must round exactly where the CPU reference does. No fused multiply-add (a
    contracted ``x * inv + 1.5 * 2**23`` rounds differently), only correctly rounded ``.rn``
    arithmetic and division (Triton's plain ``/`` would be ``div.full``), and nothing that flushes
    subnormals (``.ftz``)."""
    from lightning_islands import triton_kernels as tk
    from lightning_islands.codecs import PACK_GROUP

    programs = {}
    for block in (128, 96, 4096):
        rows, chunk = tk.scale_tiling(block)
        programs[f"scales/{block}"] = tk.ptx("scales", arch, BLOCK=block, ROWS=rows, CHUNK=chunk)
    for (bits, fp8), block in zip(_VARIANTS, (128, 96, 4096, 36)):
        const = {"BLOCK": block, "BITS": bits, "OFFSET": tk.offset(bits), "FP8": fp8, "GROUP": PACK_GROUP}
        programs[f"encode/{bits}/{fp8}/{block}"] = tk.ptx("encode", arch, **const)
        programs[f"decode/{bits}/{fp8}/{block}"] = tk.ptx("decode", arch, **const)
    for (bits, fp8), block in zip(_VARIANTS, (4096, 128, 64, 16384)):
        const = {"BLOCK": block, "UNIT": tk.one_pass_unit(block, PACK_GROUP), "BITS": bits, "OFFSET": tk.offset(bits),
                 "FP8": fp8, "GROUP": PACK_GROUP}
        programs[f"units/{bits}/{fp8}/{block}"] = tk.ptx("units", arch, **const)
    for name, text in programs.items():
        ops = [line.split()[0] for line in text.splitlines() if line.strip() and not line.strip().startswith("//")]
        float_ops = {op for op in ops if ".f32" in op or ".f16" in op}
        assert not [op for op in float_ops if "fma" in op or "ftz" in op or "approx" in op or "full" in op], (
            name, sorted(float_ops))
        arithmetic = {op for op in float_ops if op.split(".")[0] in ("add", "sub", "mul", "div")}
        assert arithmetic and all(".rn." in op for op in arithmetic), (name, sorted(arithmetic))
        if name.startswith(("scales", "units")):
            assert "div.rn.f32" in float_ops, sorted(float_ops)


@pytest.mark.parametrize("arch", [80, 90, 100])
@pytest.mark.parametrize("bits, group", [(8, 1024), (32, 256)])
def test_the_crc_kernel_addresses_bodies_over_2_gib(arch, bits, group):
    """Compiled for bodies of 2 GiB and more (64-bit lengths), read without a GPU: the program id
    is widened to 64 bits before any arithmetic (``pid * ROWS * GROUP`` in 32 bits wraps past
    2**31 bytes and folds the wrong bytes), and the store of each raw CRC is guarded by a 64-bit
    comparison with ``ngroups`` (the last program's rows past the end must not be written)."""
    import re

    from lightning_islands import triton_crc

    text = triton_crc.ptx(arch, bits, group)
    lines = [line.split("//")[0].strip() for line in text.splitlines()]
    pid = [m.group(1) for line in lines if (m := re.match(r"mov\.u32\s+(%r\d+), %ctaid\.x;", line))]
    assert len(pid) == 1, pid
    uses = [line for line in lines if re.search(re.escape(pid[0]) + r"[,;]", line) and "%ctaid" not in line]
    assert uses and all(".wide." in line.split()[0] or line.split()[0] in ("cvt.u64.u32", "cvt.s64.s32")
                        for line in uses), uses
    ngroups = [m.group(1) for line in lines if (m := re.match(r"ld\.param\.b64\s+(%rd\d+), \[_fold_param_5\];", line))]
    assert len(ngroups) == 1, "ngroups is not read: the store is not guarded"
    assert any(re.match(r"setp\.lt\.s64\s+%p\d+, %rd\d+, " + re.escape(ngroups[0]) + ";", line) for line in lines)
    stores = [line for line in lines if "st.global" in line]
    assert stores and all(line.startswith("@%p") for line in stores), stores


def test_every_launch_switches_fp_fusion_off(monkeypatch):
    """The PTX test compiles with the options the launches use; this pins that the launches use them."""
    from types import SimpleNamespace

    import torch

    from lightning_islands import triton_kernels as tk

    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, kwargs))

    fake = SimpleNamespace(**{name: Recorder(name) for name in ("scales", "encode", "units", "decode")})
    monkeypatch.setattr(tk, "kernels", lambda: fake)
    x = torch.randn(5000)
    tk.encode_blockwise(x, torch.empty(40), torch.empty(2500, dtype=torch.uint8), 128, 4, False, 7.0, 2048)
    tk.decode_blockwise(torch.empty(2500, dtype=torch.uint8), torch.empty(40), x, 128, 4, False, 2048)
    assert [name for name, _ in launches] == ["units", "scales", "encode", "decode"]  # 4096 values in one pass
    assert all(kwargs.get("enable_fp_fusion") is False for _, kwargs in launches), launches
