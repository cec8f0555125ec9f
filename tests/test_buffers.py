"""lightning_islands/codecs/buffers.py: named scratch tensors reused across the passes of a loop."""

from __future__ import annotations

import torch

from lightning_islands.codecs.buffers import Buffers


def test_take_reuses_the_named_buffer_while_it_is_big_enough():
    buffers = Buffers()
    first = buffers.take("a", 1000)
    assert first.shape == (1000,) and first.dtype == torch.float32 and first.is_contiguous()
    smaller = buffers.take("a", 10)
    assert smaller.shape == (10,) and smaller.data_ptr() == first.data_ptr()  # the same memory
    other = buffers.take("b", 10)
    assert other.data_ptr() != first.data_ptr()  # names do not share
    grown = buffers.take("a", 2000)
    assert grown.shape == (2000,) and buffers.take("a", 1500).data_ptr() == grown.data_ptr()


def test_take_allocates_anew_for_another_dtype_and_clear_drops_everything():
    buffers = Buffers()
    floats = buffers.take("x", 64)
    raw = buffers.take("x", 64, torch.uint8)
    assert raw.dtype == torch.uint8 and raw.shape == (64,)
    assert buffers.take("x", 64, torch.uint8).data_ptr() == raw.data_ptr()
    floats.fill_(1.0)
    raw.fill_(3)
    buffers.clear()
    fresh = buffers.take("x", 64, torch.uint8)
    fresh.fill_(9)  # whatever memory it got, the tensors taken before keep theirs
    assert torch.equal(floats, torch.ones(64)) and torch.equal(raw, torch.full((64,), 3, dtype=torch.uint8))
