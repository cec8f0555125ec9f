"""The outer-step math on plain tensors: SGD semantics, merge weights, shard invariance."""

from __future__ import annotations

import pytest
import references
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_islands.engine import outer


@pytest.mark.parametrize("momentum, nesterov, wd", [(0.0, False, 0.0), (0.9, False, 0.0), (0.9, True, 0.0),
                                                    (0.5, True, 0.01)])
def test_outer_sgd_follows_torch_optim_sgd(momentum, nesterov, wd):
    g = torch.Generator().manual_seed(0)
    p_ref = torch.randn(37, generator=g, requires_grad=True)
    p = p_ref.detach().clone()
    ref = torch.optim.SGD([p_ref], lr=0.7, momentum=momentum, nesterov=nesterov, weight_decay=wd)
    mine = outer.OuterSGD(lr=0.7, momentum=momentum, nesterov=nesterov, weight_decay=wd)
    for _ in range(6):
        grad = torch.randn(37, generator=g)
        p_ref.grad = grad.clone()
        ref.step()
        mine.step([p], [grad])
        torch.testing.assert_close(p, p_ref.detach(), rtol=1e-6, atol=1e-6)
    assert mine.steps == 6


def test_lr1_momentum0_is_plain_averaging():
    anchor = torch.tensor([1.0, 2.0, 3.0])
    locals_ = [torch.tensor([0.0, 2.0, 4.0]), torch.tensor([2.0, 2.0, 0.0])]
    deltas = [outer.pseudo_gradient(anchor, loc) for loc in locals_]
    merged = outer.merge(deltas, [1.0, 3.0])
    outer.OuterSGD(lr=1.0, momentum=0.0, nesterov=False).step([anchor], [merged])
    torch.testing.assert_close(anchor, 0.25 * locals_[0] + 0.75 * locals_[1])


def test_merge_weights_tokens_and_zero_fallback():
    assert outer.merge_weights([2.0, 6.0]) == [0.25, 0.75]
    assert outer.merge_weights([0.0, 0.0]) == [0.5, 0.5]
    with pytest.raises(ValueError, match="non-negative"):
        outer.merge_weights([1.0, -1.0])
    with pytest.raises(ValueError, match="2 pseudo-gradients but 1 weights"):
        outer.merge([torch.zeros(2), torch.zeros(2)], [1.0])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), cuts=st.lists(st.integers(0, 3000), max_size=4), seed=st.integers(0, 2**16))
def test_outer_step_on_shards_is_bit_identical_to_full_vector(n, cuts, seed):
    """Islands shard differently; every element's result must not depend on where shards begin."""
    g = torch.Generator().manual_seed(seed)
    anchor = torch.randn(n, generator=g)
    deltas = [torch.randn(n, generator=g) * 1e-2 for _ in range(3)]
    weights = [3.0, 1.0, 7.0]
    full_opt = outer.OuterSGD()
    full = anchor.clone()
    bounds = sorted({0, n, *[c % (n + 1) for c in cuts]})
    pieces = [anchor[a:b].clone() for a, b in zip(bounds, bounds[1:])]
    shard_opt = outer.OuterSGD()
    for _ in range(3):
        merged = outer.merge(deltas, weights)
        full_opt.step([full], [merged])
        shard_opt.step(pieces, [merged[a:b] for a, b in zip(bounds, bounds[1:])])
    assert torch.equal(torch.cat(pieces), full)


def test_cosine_and_settings():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    assert references.cosine(a, b) == 0.0 and references.cosine(a, a) == pytest.approx(1.0)
    assert references.mean_pairwise_cosine([a]) == 1.0
    assert references.cosine(a, torch.zeros(2)) == 0.0
    with pytest.raises(ValueError, match="Nesterov"):
        outer.OuterSGD(momentum=0.0, nesterov=True)
    opt = outer.OuterSGD()
    opt.step([torch.zeros(2)], [torch.ones(2)])
    restored = outer.OuterSGD()
    restored.load_state_dict(opt.state_dict())
    assert restored.steps == 1 and torch.equal(restored.buffers[0], opt.buffers[0])


def test_token_and_expert_weighting_match_a_hand_computed_example():
    """Two islands, one MoE parameter with 2 experts (rows) and one dense parameter.

    Island A processed 100 tokens and routed them all to expert 0; island B processed 300 tokens,
    60 to expert 0 and 240 to expert 1. Token weighting gives every element 1/4 of A and 3/4 of B.
    Expert-aware weighting gives expert 0 rows 100/160 of A and 60/160 of B, and expert 1 rows all of
    B: A's zero update for an expert it never used must not dilute B's.
    """
    a = torch.tensor([[1.0, 1.0], [0.0, 0.0]])  # A never touched expert 1
    b = torch.tensor([[2.0, 2.0], [4.0, 4.0]])
    dense = outer.merge([torch.tensor([1.0]), torch.tensor([5.0])], [100.0, 300.0])
    assert dense.item() == pytest.approx(0.25 * 1.0 + 0.75 * 5.0)
    token_weighted = outer.merge([a, b], [100.0, 300.0])
    torch.testing.assert_close(token_weighted, torch.tensor([[1.75, 1.75], [3.0, 3.0]]))
    coefs = outer.expert_coefficients([[100.0, 0.0], [60.0, 240.0]])
    torch.testing.assert_close(coefs[0], torch.tensor([0.625, 0.0]))
    torch.testing.assert_close(coefs[1], torch.tensor([0.375, 1.0]))
    expert_weighted = references.merge_experts([a, b], coefs)
    torch.testing.assert_close(expert_weighted, torch.tensor([[1.375, 1.375], [4.0, 4.0]]))
    assert expert_weighted[1, 0] > token_weighted[1, 0], "expert 1 keeps B's full update"


def test_expert_share_gap_of_the_hand_computed_example():
    """The example above: A's token share is 1/4 and B's 3/4; expert 0's coefficients are 5/8 and
    3/8 (gap 3/8 for both islands), expert 1's are 0 and 1 (gap 1/4). Weighted by the 160 and 240
    tokens the experts received, the mean gap is (3/8 * 160 + 1/4 * 240) / 400 = 0.3."""
    largest, mean = outer.expert_share_gap([[100.0, 0.0], [60.0, 240.0]], [100.0, 300.0])
    assert largest == pytest.approx(0.375) and mean == pytest.approx(0.3)
    # islands that split every expert as they split their tokens: expert weighting changes nothing
    assert outer.expert_share_gap([[10.0, 30.0], [20.0, 60.0]], [40.0, 80.0]) == (0.0, 0.0)
    # nobody routed a token: equal shares against token shares 1/4, 3/4, and no tokens to weight a mean
    assert outer.expert_share_gap([[0.0], [0.0]], [1.0, 3.0]) == (pytest.approx(0.25), 0.0)


def test_expert_counts_nobody_routed_to_fall_back_to_equal_and_bad_counts_fail():
    coefs = outer.expert_coefficients([[0.0, 1.0], [0.0, 3.0]])
    torch.testing.assert_close(coefs[0], torch.tensor([0.5, 0.25]))
    with pytest.raises(ValueError, match="non-negative"):
        outer.expert_coefficients([[-1.0], [1.0]])


def test_expert_rows_of_any_slice_merge_as_the_whole_parameter_does():
    g = torch.Generator().manual_seed(3)
    deltas = [torch.randn(4, 3, 5, generator=g) for _ in range(3)]
    coefs = outer.expert_coefficients([[10.0, 0.0, 5.0, 1.0], [0.0, 0.0, 5.0, 2.0], [30.0, 0.0, 1.0, 0.0]])
    whole = references.merge_experts(deltas, coefs).reshape(-1)
    flat = [d.reshape(-1) for d in deltas]
    assert torch.equal(outer.merge_expert_rows(flat, coefs, 15, 0), whole)
    for a, b in ((0, 7), (7, 31), (29, 60), (44, 46), (59, 60)):  # slices that cut rows
        assert torch.equal(outer.merge_expert_rows([f[a:b] for f in flat], coefs, 15, a), whole[a:b]), (a, b)
    with pytest.raises(ValueError, match="row_numel"):
        outer.merge_expert_rows(flat, coefs, 0, 0)


def test_exchange_chunks_cover_the_vector_in_whole_units():
    assert outer.exchange_chunk_numel(None, 2048) is None and outer.exchange_chunk_numel(0, 2048) is None
    assert outer.exchange_chunk_numel(1024, 2048) == 1 << 28
    assert outer.exchange_chunk_numel(1, 6400) == (1 << 18) // 6400 * 6400  # block 100: lcm(100, 2048)
    assert outer.exchange_chunk_numel(1e-6, 2048) == 2048  # at least one unit
    with pytest.raises(ValueError, match="MiB"):
        outer.exchange_chunk_numel(-1, 2048)
    assert outer.chunk_bounds(10, None) == [(0, 10)] and outer.chunk_bounds(10, 10) == [(0, 10)]
    assert outer.chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert outer.chunk_bounds(0, 4) == [(0, 0)]
    with pytest.raises(ValueError, match="chunk"):
        outer.chunk_bounds(10, 0)


def test_merge_into_given_buffers_gives_the_same_bits():
    """``out`` and ``scratch`` change where the merge writes, not what: bit for bit the merge of new
    tensors, for one, two and three islands, with the buffers holding garbage first."""
    g = torch.Generator().manual_seed(9)
    deltas = [torch.randn(1001, generator=g) * 10.0 ** e for e in (-3, 0, 2)]
    weights = [8192.0, 16384.0, 3.0]
    for count in (1, 2, 3):
        want = outer.merge(deltas[:count], weights[:count])
        out, scratch = torch.full((1001,), float("nan")), torch.full((1001,), 7.0)
        got = outer.merge(deltas[:count], weights[:count], out=out, scratch=scratch)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), count


def test_outer_warmup_follows_torch_optim_sgd_with_a_ramped_lr_and_momentum():
    """Step t (from 1) uses min(1, t/W) of the lr and of the momentum: torch's SGD with the group's
    lr and momentum set to those values before each step does the same."""
    g = torch.Generator().manual_seed(1)
    p_ref = torch.randn(29, generator=g, requires_grad=True)
    p = p_ref.detach().clone()
    ref = torch.optim.SGD([p_ref], lr=0.7, momentum=0.5, nesterov=True)
    mine = outer.OuterSGD(lr=0.7, momentum=0.5, nesterov=True, lr_warmup=4, momentum_warmup=3)
    assert [mine.lr_at(t) for t in range(1, 6)] == pytest.approx([0.175, 0.35, 0.525, 0.7, 0.7])
    assert [mine.momentum_at(t) for t in range(1, 5)] == pytest.approx([0.5 / 3, 1 / 3, 0.5, 0.5])
    for t in range(1, 7):
        ref.param_groups[0]["lr"] = 0.7 * min(1.0, t / 4)
        ref.param_groups[0]["momentum"] = 0.5 * min(1.0, t / 3)
        grad = torch.randn(29, generator=g)
        p_ref.grad = grad.clone()
        ref.step()
        mine.step([p], [grad])
        torch.testing.assert_close(p, p_ref.detach(), rtol=1e-6, atol=1e-6)
    assert mine.settings()["lr_warmup"] == 4 and mine.settings()["momentum_warmup"] == 3


def test_outer_warmup_resumes_where_it_stopped_and_rejects_bad_values():
    opt = outer.OuterSGD(lr=1.0, momentum=0.5, lr_warmup=10)
    for _ in range(3):
        opt.step([torch.zeros(2)], [torch.ones(2)])
    restored = outer.OuterSGD(lr=1.0, momentum=0.5, lr_warmup=10)
    restored.load_state_dict(opt.state_dict())
    assert restored.lr_at(restored.steps + 1) == pytest.approx(0.4)
    # no warm-up: every step uses the full values
    assert outer.OuterSGD(lr=0.7).lr_at(1) == 0.7 and outer.OuterSGD(momentum=0.9).momentum_at(1) == 0.9
    with pytest.raises(ValueError, match="must be >= 0"):
        outer.OuterSGD(lr_warmup=-1)
    with pytest.raises(ValueError, match="momentum is 0"):
        outer.OuterSGD(momentum=0.0, nesterov=False, momentum_warmup=5)
