"""The GPU codec kernels (lightning_islands/codecs/triton_kernels.py, triton_crc.py), checked on the CPU.

Triton's interpreter runs the same kernel source on CPU tensors when ``TRITON_INTERPRET=1`` is set
before triton is imported, and ``LI_TRITON=interpret`` routes the blockwise codecs' CPU tensors to
the Triton kernels. :func:`test_the_kernels_under_triton_interpreter` starts one such Python
process: a pytest session of the ``interpreted`` tests below plus the tests of test_codecs.py and
test_wire_fixtures.py that pin bytes (Triton path vs torch reference bit for bit on random and
edge-case vectors, the pinned payloads, the packed layout, every fp8 code). What the interpreter
cannot show is how a GPU
compiler rounds. Two checks stand in for it: the kernels are compiled here to PTX for three GPU
generations and their arithmetic is read (no contraction, no approximation, no flushing), and on a
GPU each codec compares the kernels with the torch path on a probe before first use
(tests/test_codec_probe.py shows that the probe catches each rounding fault; the tests below show
what happens when the comparison fails).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
import warnings
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_islands.codecs import PACK_GROUP, blockwise, checksum, make_codec, paths

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (it is on Linux x86_64, with the test extra)")

# this process runs the codecs' Triton kernels in Triton's interpreter (the session started below)
INTERPRETED = paths.triton_mode() == "interpret" and os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreted session started by "
                                 "test_the_kernels_under_triton_interpreter")
# What the codecs say when a Triton kernel fails its check or triton is missing: an error in the
# interpreted session, so a run that silently fell back to the torch path cannot pass as a run of the kernels.
_NO_FALLBACK = ["-W", "error:lightning_islands. the Triton kernels", "-W", "error:lightning_islands. triton is not"]
# the tests of the interpreted session: those of this file marked `interpreted`, and those of
# test_codecs.py / test_wire_fixtures.py that pin bytes and behaviour of the blockwise codecs
_SELECTION = "interpreted or triton_kernels_match or packed_layout or every_code or decode_is_q_times or stored_bytes"


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted session")
def test_the_kernels_under_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "LI_TRITON": "interpret", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, *_NO_FALLBACK, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "--durations=5",
         "-W", "ignore::RuntimeWarning", *_NO_FALLBACK, "-k", _SELECTION,
         "tests/test_triton_kernels.py", "tests/test_codecs.py", "tests/test_wire_fixtures.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout and " skipped" not in proc.stdout, (
        proc.stdout[-3000:])


@pytest.fixture
def fresh_trust(monkeypatch):
    """Each codec checks the kernels again on first use (the check is once per process otherwise)."""
    monkeypatch.setattr(blockwise, "TRITON_TRUSTED", {})
    return blockwise.TRITON_TRUSTED


@interpreted
def test_interpreted_blockwise_codecs_run_the_triton_kernels_and_trust_them(fresh_trust, monkeypatch):
    from lightning_islands.codecs import triton_kernels

    calls = []
    real = triton_kernels.encode_blockwise
    monkeypatch.setattr(triton_kernels, "encode_blockwise", lambda *a: (calls.append(a[4]), real(*a))[1])
    x = torch.randn(9001, generator=torch.Generator().manual_seed(1))
    for spec in ["int8", "int4/96", "int2/4096", "fp8/36"]:
        codec = make_codec(spec)
        payload = codec.encode(x)
        decoded = codec.decode(payload)
        monkeypatch.setenv("LI_TRITON", "0")  # the torch path
        assert torch.equal(payload, codec.encode(x)), spec
        assert torch.equal(decoded.view(torch.int32), codec.decode(payload).view(torch.int32)), spec
        monkeypatch.setenv("LI_TRITON", "interpret")
    # each codec: the two probes of its first-use check (whole, and cut short), then the real encode
    assert calls == [8, 8, 8, 4, 4, 4, 2, 2, 2, 8, 8, 8]
    assert fresh_trust == {("cpu", "fp8/36"): True, ("cpu", "int2/4096"): True, ("cpu", "int4/96"): True,
                           ("cpu", "int8/128"): True}


@interpreted
def test_interpreted_li_triton_0_keeps_the_kernels_off(fresh_trust, monkeypatch):
    monkeypatch.setenv("LI_TRITON", "0")
    make_codec("int4").encode(torch.ones(8))
    assert fresh_trust == {}


@interpreted
@pytest.mark.parametrize("fault", ["encode_bit", "decode_bit", "no_compile"])
def test_interpreted_a_kernel_that_disagrees_with_the_reference_is_not_used(fault, fresh_trust, monkeypatch):
    """The first-use check compares a probe's bytes and decoded bits with the torch path; a kernel
    that differs in one bit (or does not compile) is dropped with a warning, and the payload stays
    the reference one. (Which faults the probe reveals: tests/test_codec_probe.py.)"""
    from lightning_islands.codecs import triton_kernels

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

    monkeypatch.setattr(triton_kernels, "encode_blockwise", bad_encode)
    monkeypatch.setattr(triton_kernels, "decode_blockwise", bad_decode)
    codec = make_codec("int4")
    x = torch.randn(9000, generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        payload = codec.encode(x)
        decoded = codec.decode(payload)
    assert fresh_trust == {("cpu", "int4/128"): False}
    said = [str(w.message) for w in caught if "the Triton kernels of codec 'int4/128' on cpu failed" in str(w.message)]
    expected = {"encode_bit": "encode of", "decode_bit": "decode of", "no_compile": "PassManager"}[fault]
    assert len(said) == 1 and expected in said[0] and "uses the slower torch path" in said[0], said
    monkeypatch.setenv("LI_TRITON", "0")
    assert torch.equal(payload, codec.encode(x))
    assert torch.equal(decoded, codec.decode(payload))


@interpreted
@pytest.mark.parametrize("one_pass", ["1", "0"])
def test_interpreted_one_pass_encoder_gives_the_reference_bytes(one_pass, monkeypatch):
    """Whole units (power-of-two blocks up to 16384 values, with a packing group or several per
    unit, or several blocks per group) go through the one-pass encoder, the rest through the
    two-pass one; on each codec's probe (ties, rounded ties, subnormal and near-overflow blocks),
    whole and cut short, both give the torch path's bytes. A NaN or an Inf in a block shows in
    that block's scale (the codec then refuses the input). ``LI_TRITON_ONE_PASS=0`` keeps every
    value on the two-pass encoder."""
    from lightning_islands.codecs import probe as codec_probe
    from lightning_islands.codecs import triton_kernels as tk

    monkeypatch.setenv("LI_TRITON_ONE_PASS", one_pass)
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

    monkeypatch.setattr(tk, "kernels", lambda: SimpleNamespace(**{n: Spy(n) for n in real.__dict__}))
    assert tk.one_pass_unit(32768, PACK_GROUP) is None  # blocks above 16384 values: two passes
    specs = ["int8/64", "int4", "int2/2048", "fp8/4096", "int4/16384", "int2/96"]
    for spec in specs if one_pass == "1" else specs[:4]:  # big probes cost seconds each in two passes
        codec = make_codec(spec)
        bits, block = int(codec.bits), codec.block_size
        unit = tk.one_pass_unit(block, PACK_GROUP)
        if one_pass == "0" or block == 96:
            assert unit is None, spec
        else:
            assert unit == max(4096, block), spec
        whole = codec_probe.probe(block, codec.qmax, codec.fp8)
        for x in (whole, whole[: whole.numel() - 5]):
            n = x.numel()
            nb = -(-n // block)
            scales = torch.empty(nb)
            values = torch.empty(-(-n // codec.pack), dtype=torch.uint8)
            launched.clear()
            tk.encode_blockwise(x, scales, values, block, bits, codec.fp8, codec.qmax, PACK_GROUP)
            ref = torch.zeros(4 * nb + values.numel(), dtype=torch.uint8)
            codec._torch_encode(x, *codec._body_parts(ref, n))
            assert torch.equal(scales.view(torch.uint8), ref[: 4 * nb]), spec
            assert torch.equal(values, ref[4 * nb :]), spec
            assert ("units" in launched) == (unit is not None and n >= unit), (spec, n, launched)
            assert ("scales" in launched) == (unit is None or n % unit > 0), (spec, n, launched)
        bad = torch.randn(5 * (unit or block))
        bad[3 * block + 1], bad[2 * block + 7] = float("nan"), float("-inf")
        scales = torch.empty(-(-bad.numel() // block))
        tk.encode_blockwise(bad, scales, torch.empty(-(-bad.numel() // codec.pack), dtype=torch.uint8), block, bits,
                            codec.fp8, codec.qmax, PACK_GROUP)
        assert math.isnan(scales[3]) and scales[2] == math.inf and torch.isfinite(scales[4:]).all(), spec


@interpreted
@pytest.mark.parametrize("n, byte_group, raw_group, rows",
                         [(1, 2, 2, 1), (2, 2, 2, 1), (33, 2, 2, 1), (64, 16, 4, 1), (300, 16, 4, 8), (257, 256, 2, 1),
                          (2000, 1024, 256, 1)])
def test_interpreted_gpu_crc_kernel_gives_zlibs_crc32(n, byte_group, raw_group, rows, monkeypatch):
    """lightning_islands/codecs/triton_crc.py: the fold tree gives zlib's CRC-32 for lengths that fill,
    straddle and miss its groups, over one to six levels, with one group per program and with
    several (the last program's extra rows masked). Small fan-ins make deep trees cheap under the
    interpreter; the defaults (1024, then 256) run too."""
    from lightning_islands.codecs import crc32, triton_crc

    monkeypatch.setattr(triton_crc, "_ROWS", rows)  # the interpreter computes masked rows too: 1 is cheap
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    raw = triton_crc.raw_crc(data, byte_group, raw_group)
    for start in (0, 0xFFFFFFFF, 0x5EED):
        assert crc32.from_raw(start, raw, n) == zlib.crc32(data.numpy().tobytes(), start)


@interpreted
def test_interpreted_crc_kernel_checks_its_arguments_and_passes_its_first_use_check(monkeypatch):
    from lightning_islands.codecs import triton_crc

    data = torch.zeros(10, dtype=torch.uint8)
    assert triton_crc.raw_crc(data[:0]) == 0
    for bad in ((data.view(torch.int8),), (data, 3, 2), (data, 1024, 1)):
        with pytest.raises(ValueError):
            triton_crc.raw_crc(*bad)
    monkeypatch.setattr(triton_crc, "_ROWS", 1)
    monkeypatch.setattr(checksum, "CRC_PROBE_BYTES", 777)  # the real probe takes minutes under the interpreter
    monkeypatch.setattr(checksum, "CRC_KERNEL_TRUSTED", {})
    assert checksum.crc_kernel_trusted(triton_crc, torch.device("cpu"))


@pytest.mark.skipif(INTERPRETED, reason="needs a process without the interpreter")
def test_interpret_mode_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("LI_TRITON", "interpret")
    with pytest.raises(RuntimeError, match=r"LI_TRITON=interpret .* TRITON_INTERPRET=1"):
        make_codec("int4").encode(torch.ones(8))


# (bits, fp8) of fp8, int8, int4 and int2
_VARIANTS = [(8, True), (8, False), (4, False), (2, False)]
# the kernels' argument types, for compiling them ahead of time
_SIGNATURES = {
    "scales": {"x_ptr": "*fp32", "scale_ptr": "*fp32", "inv_ptr": "*fp32", "count": "i64", "nblocks": "i64",
               "qmax": "fp32"},
    "encode": {"x_ptr": "*fp32", "inv_ptr": "*fp32", "out_ptr": "*u8", "count": "i64"},
    "units": {"x_ptr": "*fp32", "scale_ptr": "*fp32", "out_ptr": "*u8", "qmax": "fp32"},
    "decode": {"val_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": "*fp32", "count": "i64"},
}


def _ptx(fn, signature: dict, constexprs: dict, arch: int, options: dict | None = None) -> str:
    """PTX of the Triton function ``fn`` for compute capability ``arch`` (80 Ampere, 90 Hopper, 100
    Blackwell), compiled without a GPU (Triton ships its own LLVM and ptxas); ``signature`` types
    every argument, constexprs included."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options or {}).asm["ptx"]


def _kernel_ptx(kernel: str, arch: int, **constexprs: int | bool) -> str:
    """One codec kernel compiled with the launch options the codecs use."""
    from lightning_islands.codecs import triton_kernels as tk

    signature = {**_SIGNATURES[kernel], **{name: "constexpr" for name in constexprs}}
    return _ptx(getattr(tk.kernels(), kernel), signature, constexprs, arch, tk._OPTIONS)


@pytest.mark.skipif(INTERPRETED, reason="compiles for GPUs")
@pytest.mark.parametrize("arch", [80, 90, 100])
def test_the_kernels_compile_for_gpus_with_every_rounding_as_written(arch):
    """Compiled for Ampere, Hopper and Blackwell without a GPU (Triton ships its own LLVM and
    ptxas): the PTX must round exactly where the CPU reference does. No fused multiply-add (a
    contracted ``x * inv + 1.5 * 2**23`` rounds differently), only correctly rounded ``.rn``
    arithmetic and division (Triton's plain ``/`` would be ``div.full``), and nothing that flushes
    subnormals (``.ftz``)."""
    from lightning_islands.codecs import triton_kernels as tk

    # every kernel, each way its floating-point code differs: fp8 codes against integer ones, and
    # the int8 decode's conversion (from a byte) against the packed ones' (from an int32); the
    # integer bit fields of int4 and int2 do not change the float arithmetic, nor do block sizes
    programs = {}
    rows, chunk = tk.scale_tiling(96)
    programs["scales/96"] = _kernel_ptx("scales", arch, BLOCK=96, ROWS=rows, CHUNK=chunk)
    for (bits, fp8), block in zip(_VARIANTS, (128, 96, 4096, 36)):
        const = {"BLOCK": block, "BITS": bits, "OFFSET": tk.offset(bits), "FP8": fp8, "GROUP": PACK_GROUP}
        if bits != 2:
            programs[f"decode/{bits}/{fp8}/{block}"] = _kernel_ptx("decode", arch, **const)
        if bits == 4 or fp8:
            programs[f"encode/{bits}/{fp8}/{block}"] = _kernel_ptx("encode", arch, **const)
    for (bits, fp8), block in zip(_VARIANTS, (4096, 128, 64, 16384)):
        if bits == 4 or fp8:
            const = {"BLOCK": block, "UNIT": tk.one_pass_unit(block, PACK_GROUP), "BITS": bits,
                     "OFFSET": tk.offset(bits), "FP8": fp8, "GROUP": PACK_GROUP}
            programs[f"units/{bits}/{fp8}/{block}"] = _kernel_ptx("units", arch, **const)
    for name, text in programs.items():
        ops = [line.split()[0] for line in text.splitlines() if line.strip() and not line.strip().startswith("//")]
        float_ops = {op for op in ops if ".f32" in op or ".f16" in op}
        assert not [op for op in float_ops if "fma" in op or "ftz" in op or "approx" in op or "full" in op], (
            name, sorted(float_ops))
        arithmetic = {op for op in float_ops if op.split(".")[0] in ("add", "sub", "mul", "div")}
        assert arithmetic and all(".rn." in op for op in arithmetic), (name, sorted(arithmetic))
        if name.startswith(("scales", "units")):
            assert "div.rn.f32" in float_ops, sorted(float_ops)


@pytest.mark.skipif(INTERPRETED, reason="compiles for GPUs")
@pytest.mark.parametrize("arch", [80, 90, 100])
@pytest.mark.parametrize("bits, group", [(8, 1024), (32, 256)])
def test_the_crc_kernel_addresses_bodies_over_2_gib(arch, bits, group):
    """Compiled for bodies of 2 GiB and more (64-bit lengths), read without a GPU: the program id
    is widened to 64 bits before any arithmetic (``pid * ROWS * GROUP`` in 32 bits wraps past
    2**31 bytes and folds the wrong bytes), and the store of each raw CRC is guarded by a 64-bit
    comparison with ``ngroups`` (the last program's rows past the end must not be written)."""
    from lightning_islands.codecs import triton_crc

    signature = {"src_ptr": "*u8" if bits == 8 else "*i32", "tab_ptr": "*i32", "out_ptr": "*i32", "n": "i64",
                 "pad": "i32", "ngroups": "i64", "BITS": "constexpr", "GROUP": "constexpr", "ROWS": "constexpr"}
    text = _ptx(triton_crc._fold, signature, {"BITS": bits, "GROUP": group, "ROWS": triton_crc._ROWS}, arch)
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
    from lightning_islands.codecs import triton_kernels as tk

    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, kwargs))

    fake = SimpleNamespace(**{name: Recorder(name) for name in ("scales", "encode", "units", "decode")})
    monkeypatch.setattr(tk, "kernels", lambda: fake)
    monkeypatch.delenv("LI_TRITON_ONE_PASS", raising=False)
    x = torch.randn(5000)
    tk.encode_blockwise(x, torch.empty(40), torch.empty(2500, dtype=torch.uint8), 128, 4, False, 7.0, 2048)
    tk.decode_blockwise(torch.empty(2500, dtype=torch.uint8), torch.empty(40), x, 128, 4, False, 2048)
    assert [name for name, _ in launches] == ["units", "scales", "encode", "decode"]  # 4096 values in one pass
    assert all(kwargs.get("enable_fp_fusion") is False for _, kwargs in launches), launches
