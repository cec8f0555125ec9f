"""The wire format, pinned: stored payloads that every version must write and read bit for bit.

``tests/fixtures/wire/`` holds one fixed input vector (``input.f32``: 3001 little-endian fp32
values whose magnitudes vary by block, with scattered zeros, an all-zero block, -0.0, subnormals
and a few very large values; 3001 is a multiple neither of the block size nor of the packing
group) and, per codec spec, the payload the codecs wrote for it (``<name>.bin``) and what that
payload decodes to (``<name>.f32``, raw little-endian fp32). A change to the codecs that alters
one byte of a payload, or one bit of a decode, fails here: islands running different versions
would no longer agree. Regenerate the files only for a deliberate format change (with a new
FORMAT_VERSION): ``python tests/test_wire_fixtures.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_islands.codecs import make_codec

FIXTURES = Path(__file__).parent / "fixtures" / "wire"
N = 3001
# codec spec -> file stem
SPECS = {
    "fp32": "fp32",
    "bf16": "bf16",
    "fp8": "fp8",
    "int8": "int8",
    "int4": "int4",
    "int2": "int2",
    "sign": "sign",
    "topk:0.1": "topk0.1",
    "topk:0.1+int4": "topk0.1+int4",
    "topk:0.1+int2": "topk0.1+int2",
    "int4/64": "int4-b64",
}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_input() -> torch.Tensor:
    """The fixture's input vector (used only to write ``input.f32``; the tests read the file)."""
    g = torch.Generator().manual_seed(0x5EED)
    x = torch.randn(N, generator=g)
    x *= 2.0 ** torch.randint(-6, 7, (N // 128 + 1,), generator=g).float().repeat_interleave(128)[:N]  # per block
    x[::7] = 0.0  # scattered zeros
    x[256:384] = 0.0  # one all-zero block of 128
    x[[11, 600, 2999]] = -0.0
    x[[13, 1500]] = torch.tensor([1e-42, -3e-40])  # subnormals
    x[[5, 40, 77, 130, 200]] = torch.tensor([3.0e38, -1.0e30, 65504.0, -2.5e20, 7.0e33])  # large, in two blocks
    return x


def _read_f32(path: Path) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype="<f4").astype(np.float32))


def _read_u8(path: Path) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


def test_the_input_is_as_described():
    x = _read_f32(FIXTURES / "input.f32")
    assert x.numel() == N and N % 128 and N % 2048
    assert torch.isfinite(x).all() and (x == 0).sum() > 400 and torch.signbit(x[x == 0]).any()
    assert x.abs().max() > 1e38 and ((x != 0) & (x.abs() < 1.17e-38)).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", list(SPECS))
def test_encode_writes_the_stored_bytes_and_decode_reads_the_stored_values(spec, device):
    codec = make_codec(spec)
    x = _read_f32(FIXTURES / "input.f32").to(device)
    payload = _read_u8(FIXTURES / f"{SPECS[spec]}.bin")
    values = _read_f32(FIXTURES / f"{SPECS[spec]}.f32")
    got = codec.encode(x).cpu()
    assert got.numel() == payload.numel(), spec
    assert torch.equal(got, payload), f"{spec}: {int((got != payload).sum())} bytes differ from the pinned payload"
    decoded = codec.decode(payload.to(device)).cpu()
    assert torch.equal(decoded.view(torch.int32), values.view(torch.int32)), spec


def _write() -> None:  # pragma: no cover - run by hand for a deliberate format change
    FIXTURES.mkdir(parents=True, exist_ok=True)
    x = make_input()
    x.numpy().astype("<f4").tofile(FIXTURES / "input.f32")
    for spec, stem in SPECS.items():
        codec = make_codec(spec)
        payload = codec.encode(x)
        payload.numpy().tofile(FIXTURES / f"{stem}.bin")
        codec.decode(payload).numpy().astype("<f4").tofile(FIXTURES / f"{stem}.f32")


if __name__ == "__main__":
    _write()
