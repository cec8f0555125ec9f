"""The subnormal-float probe that islands compare at rendezvous."""

from __future__ import annotations

import pytest
import torch

from lightning_islands.engine import floatenv


def test_the_probe_sees_the_flush_mode_of_the_calling_thread():
    assert not floatenv.flushes_subnormals("cpu")
    assert floatenv.describe("cpu") == floatenv.KEPT
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals (no SSE3)")
    try:
        assert floatenv.flushes_subnormals("cpu")
        assert floatenv.describe("cpu") == floatenv.FLUSHED
    finally:
        torch.set_flush_denormal(False)
    assert not floatenv.flushes_subnormals("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_keeps_subnormals():
    assert floatenv.describe(torch.device("cuda")) == floatenv.KEPT
