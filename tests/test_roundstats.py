"""A round's exchange metrics summed over chunks equal the same metrics of the whole vector."""

from __future__ import annotations

import math

import pytest
import references
import torch

from lightning_islands.codecs import make_codec, quantization_error
from lightning_islands.engine import outer
from lightning_islands.engine.stats import RoundStats, sum_sq


def _round(bounds, delta, others, codec):
    stats = RoundStats(1 + len(others), sum_sq([delta[:100], delta[100:]]))
    for a, b in bounds:
        sent = delta[a:b] + 0.5
        payload = codec.encode(sent)
        own = codec.decode(payload)
        decoded = [own] + [o[a:b] for o in others]
        stats.add(sent, own, payload.numel(), decoded, outer.merge(decoded, [1.0] * len(decoded)))
    return stats


def test_chunked_sums_give_the_whole_vector_metrics():
    g = torch.Generator().manual_seed(1)
    codec = make_codec("int4")
    n = 9000
    delta = torch.randn(n, generator=g)
    others = [torch.randn(n, generator=g), delta * 0.5 + torch.randn(n, generator=g)]
    whole = _round([(0, n)], delta, others, codec)
    chunked = _round([(0, 2048), (2048, 4096), (4096, n)], delta, others, codec)
    sent = delta + 0.5
    own = codec.decode(codec.encode(sent))
    decoded = [own] + others
    want = {
        "islands/pseudo_grad_norm": float(delta.double().norm()),
        "islands/quant_rel_error": quantization_error(sent, own),
        "islands/compression_ratio": 4.0 * n / codec.nbytes(n),
        "islands/payload_bytes": float(codec.nbytes(n)),
        "islands/merged_norm": float(outer.merge(decoded, [1.0] * 3).double().norm()),
    }
    for key, value in want.items():
        assert whole.metrics()[key] == pytest.approx(value, rel=1e-6), key
    for key in ("islands/pseudo_grad_norm", "islands/quant_rel_error", "islands/merged_norm"):
        assert chunked.metrics()[key] == pytest.approx(want[key], rel=1e-6), key
    assert chunked.metrics()["islands/payload_bytes"] == sum(codec.nbytes(m) for m in (2048, 2048, n - 4096))
    residual = float((sent - own).double().norm())  # what error feedback carries into the next round
    assert "islands/residual_norm" not in whole.metrics()
    for stats in (whole, chunked):
        assert stats.metrics(error_feedback=True)["islands/residual_norm"] == pytest.approx(residual, rel=1e-6)
    assert whole.cosine() == pytest.approx(references.mean_pairwise_cosine(decoded), rel=1e-5)
    assert chunked.cosine() == pytest.approx(references.mean_pairwise_cosine(decoded), rel=1e-5)


def test_one_island_and_zero_vectors():
    stats = RoundStats(1, 0.0)
    z = torch.zeros(8)
    stats.add(z, z, 40, [z], z)
    assert stats.cosine() == 1.0
    m = stats.metrics()
    assert m["islands/quant_rel_error"] == 0.0 and m["islands/pseudo_grad_norm"] == 0.0
    stats.add(z, torch.ones(8), 40, [z], z)  # something decoded from nothing: an infinite error
    assert math.isinf(stats.metrics()["islands/quant_rel_error"])
    pair = RoundStats(2, 0.0)
    pair.add(z, z, 40, [z, torch.ones(8)], z)
    assert pair.cosine() == 0.0
