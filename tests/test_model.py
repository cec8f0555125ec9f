"""Tests for lightning_islands.models.moe: the MoE transformer and its LightningModule."""

from __future__ import annotations

import math

import lightning
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from lightning_islands.models import (
    PRESETS,
    MoEConfig,
    MoELanguageModel,
    MoELayer,
    MoETransformer,
    count_parameters,
    lr_schedule,
)

TINY = dict(vocab_size=256, seq_len=32, d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_ff=64)


def tiny(**overrides) -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(MoEConfig(**{**TINY, **overrides}))


def tokens(b: int, t: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t), generator=g)


# ---------------------------------------------------------------------------------------------------
# The network
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_experts", [4, 0])
def test_output_shapes(n_experts):
    model = tiny(n_experts=n_experts)
    logits, aux = model(tokens(3, 20))
    assert logits.shape == (3, 20, 256)
    assert aux["aux_loss"].shape == () and aux["z_loss"].shape == ()
    if n_experts:
        assert aux["expert_counts"].shape == (2, 4)
        assert aux["expert_counts"].dtype == torch.long
    else:
        assert aux["expert_counts"].shape == (0, 0)


def test_blocks_are_a_module_list():
    model = tiny(n_layers=3)
    assert isinstance(model.blocks, torch.nn.ModuleList)
    assert len(model.blocks) == 3


def test_moe_every_layout():
    model = tiny(n_layers=5, moe_every=2)
    assert [b.is_moe for b in model.blocks] == [False, True, False, True, False]
    assert [b.mlp.moe_index for b in model.blocks if b.is_moe] == [0, 1]
    model = tiny(n_layers=3, moe_every=1)
    assert all(b.is_moe for b in model.blocks)
    assert not any(b.is_moe for b in tiny(n_experts=0).blocks)


def test_sequence_longer_than_seq_len_is_rejected():
    with pytest.raises(ValueError, match="seq_len"):
        tiny()(tokens(1, 33))


@pytest.mark.parametrize("n_experts", [4, 0])
def test_causality(n_experts):
    model = tiny(n_experts=n_experts, shared_expert=True).double().eval()
    idx = tokens(2, 24)
    base, _ = model(idx)
    for t in (0, 7, 22):
        changed = idx.clone()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 17) % 256
        out, _ = model(changed)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-10)
        assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :])  # the change is visible later


def test_routing_picks_exactly_k_experts_per_token():
    model = tiny(n_layers=3, n_experts=8, top_k=3)
    _, aux = model(tokens(4, 32))
    counts = aux["expert_counts"]
    assert counts.shape == (3, 8)
    assert counts.sum(dim=1).tolist() == [4 * 32 * 3] * 3


def reference_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Token-by-token reference for MoELayer's output."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        probs = layer.router(x[n]).softmax(-1)
        w, e = probs.topk(layer.top_k)
        w = w / w.sum()
        for weight, expert in zip(w, e.tolist()):
            h = F.silu(x[n] @ layer.w_gate[expert]) * (x[n] @ layer.w_up[expert])
            out[n] += weight * (h @ layer.w_down[expert])
        if layer.shared is not None:
            out[n] += layer.shared(x[n])
    return out


@settings(max_examples=15, deadline=None)
@given(
    n_experts=st.integers(1, 6),
    k_frac=st.floats(0.0, 1.0),
    n_tokens=st.integers(1, 24),
    shared=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_moe_layer_matches_token_by_token_reference(n_experts, k_frac, n_tokens, shared, seed):
    top_k = 1 + round(k_frac * (n_experts - 1))
    cfg = MoEConfig(d_model=8, n_heads=2, n_experts=n_experts, top_k=top_k, d_ff=12, shared_expert=shared)
    torch.manual_seed(seed)
    layer = MoELayer(cfg).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(n_tokens, 8, dtype=torch.float64)
    out, stats = layer(x)
    torch.testing.assert_close(out, reference_moe(layer, x))
    assert stats["counts"].sum().item() == n_tokens * top_k
    assert torch.isfinite(stats["aux_loss"]) and torch.isfinite(stats["z_loss"])


def test_aux_loss_is_one_for_uniform_routing():
    model = tiny(n_layers=3)
    for block in model.blocks:
        torch.nn.init.zeros_(block.mlp.router.weight)
    _, aux = model(tokens(4, 32))
    assert aux["aux_loss"].item() == pytest.approx(1.0, abs=1e-6)
    # zero logits: logsumexp = log(E)
    assert aux["z_loss"].item() == pytest.approx(math.log(4) ** 2, rel=1e-6)


def test_aux_loss_grows_with_skewed_routing():
    cfg = MoEConfig(d_model=16, n_heads=2, n_experts=4, top_k=2, d_ff=8)
    layer = MoELayer(cfg)
    x = 1.0 + 0.1 * torch.randn(64, 16)  # every token points roughly along (1, ..., 1)
    with torch.no_grad():
        layer.router.weight.zero_()
        _, uniform = layer(x)
        layer.router.weight[0] = 0.05  # mild preference for expert 0
        _, mild = layer(x)
        layer.router.weight[0] = 5.0  # strong preference for expert 0, then expert 1
        layer.router.weight[1] = 4.0
        _, strong = layer(x)
    assert uniform["aux_loss"].item() == pytest.approx(1.0, abs=1e-6)
    assert 1.0 < mild["aux_loss"].item() < strong["aux_loss"].item()
    assert torch.isfinite(strong["aux_loss"])
    # All tokens on experts 0 and 1: f = (1/2, 1/2, 0, 0), P ~ (p0, p1, 0, 0) with p0 + p1 ~ 1.
    assert strong["aux_loss"].item() == pytest.approx(2.0, abs=1e-3)


def test_every_expert_receives_gradient():
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig(n_layers=2, n_experts=8, top_k=2, seq_len=32))
    idx = tokens(4, 32)
    logits, _ = model(idx)
    # Language-model loss only: the router gets gradient through the routing weights.
    F.cross_entropy(logits.flatten(0, 1), tokens(4, 32, seed=2).flatten()).backward()
    for block in model.blocks:
        moe = block.mlp
        for p in (moe.w_gate, moe.w_up, moe.w_down, moe.router.weight):
            assert p.grad is not None
            per_expert = p.grad.flatten(1).abs().sum(dim=1)
            assert per_expert.shape == (8,)
            assert (per_expert > 0).all(), per_expert


def test_parameter_counts_match_hand_count():
    d, ff, V, E, k = 16, 32, 256, 4, 2
    attention = 4 * d * d  # wq, wk, wv + out projection, no biases
    norms = 2 * d  # two RMSNorms per block
    swiglu = 3 * d * ff
    router = d * E
    embedding = V * d
    final_norm = d

    # 2 layers, moe_every=2: block 0 dense, block 1 MoE.
    dense_block = attention + norms + swiglu
    moe_block = attention + norms + router + E * swiglu
    expected_total = embedding + final_norm + dense_block + moe_block
    expected_active = expected_total - (E - k) * swiglu

    cfg = dict(d_model=d, n_layers=2, n_heads=2, n_experts=E, top_k=k, d_ff=ff, moe_every=2)
    counts = count_parameters(MoETransformer(MoEConfig(**cfg)))
    assert counts == {"total": expected_total, "active": expected_active}
    assert expected_total == 13968 and expected_active == 10896  # written out once, for the record

    counts = count_parameters(MoETransformer(MoEConfig(**cfg, shared_expert=True)))
    assert counts == {"total": expected_total + swiglu, "active": expected_active + swiglu}

    counts = count_parameters(MoETransformer(MoEConfig(**cfg, tie_embeddings=False)))
    assert counts == {"total": expected_total + V * d, "active": expected_active + V * d}

    dense = count_parameters(MoETransformer(MoEConfig(**{**cfg, "n_experts": 0})))
    assert dense["total"] == dense["active"] == embedding + final_norm + 2 * dense_block


def test_dense_variant():
    model = tiny(n_experts=0)
    assert not any(isinstance(m, MoELayer) for m in model.modules())
    logits, aux = model(tokens(2, 16))
    assert torch.isfinite(logits).all()
    assert aux["aux_loss"].item() == 0.0 and aux["z_loss"].item() == 0.0
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_tied_embeddings():
    model = tiny()
    assert model.lm_head.weight is model.tok_emb.weight
    untied = tiny(tie_embeddings=False)
    assert untied.lm_head.weight is not untied.tok_emb.weight


def test_meta_device_build_then_materialise():
    cfg = MoEConfig(**TINY)
    with torch.device("meta"):
        model = MoETransformer(cfg)
    assert count_parameters(model) == count_parameters(MoETransformer(cfg))
    model.to_empty(device="cpu")
    model.init_weights()
    reference = MoETransformer(cfg)
    torch.testing.assert_close(model.rope_cos, reference.rope_cos)
    torch.testing.assert_close(model.rope_sin, reference.rope_sin)
    assert model.lm_head.weight is model.tok_emb.weight
    logits, _ = model(tokens(2, 8))
    assert torch.isfinite(logits).all()
    assert "rope_cos" not in model.state_dict()  # non-persistent


def test_presets():
    sizes = {}
    for name, kwargs in PRESETS.items():
        with torch.device("meta"):
            sizes[name] = count_parameters(MoETransformer(MoEConfig(**kwargs)))
    assert 1e6 < sizes["cpu"]["total"] < 4e6
    assert 1e8 < sizes["gpu"]["total"] < 2e8
    assert 3e7 < sizes["gpu_small"]["total"] < 3.5e7 and 1e7 < sizes["gpu_small"]["active"] < 1.1e7
    assert 0.95e9 < sizes["1b"]["total"] < 1.1e9
    for size in sizes.values():
        assert size["active"] < size["total"]
    model = MoETransformer(MoEConfig(**PRESETS["cpu"]))
    logits, _ = model(tokens(1, 16))
    assert logits.shape == (1, 16, 256)


@pytest.mark.parametrize("preset", ["gpu_small", "gpu", "1b"])
def test_model_configs_build_their_presets(preset):
    from hydra import compose, initialize_config_dir

    from lightning_islands.app.train import config_dir

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model=moe_{preset}"])
    built = {key: cfg.model[key] for key in PRESETS[preset]}
    assert built == PRESETS[preset]


def test_invalid_configs():
    with pytest.raises(ValueError):
        MoEConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError):
        MoEConfig(n_experts=4, top_k=5)
    with pytest.raises(ValueError):
        MoEConfig(moe_every=0)


# ---------------------------------------------------------------------------------------------------
# The LightningModule
# ---------------------------------------------------------------------------------------------------


def test_lr_schedule():
    kw = dict(warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_schedule(0, **kw) == pytest.approx(0.1)
    assert lr_schedule(9, **kw) == pytest.approx(1.0)
    assert lr_schedule(10, **kw) == pytest.approx(1.0)
    assert lr_schedule(60, **kw) == pytest.approx(0.55)  # half-way down the cosine
    assert lr_schedule(110, **kw) == pytest.approx(0.1)
    assert lr_schedule(500, **kw) == pytest.approx(0.1)
    values = [lr_schedule(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_optimizer_decays_matrices_only():
    module = MoELanguageModel(**TINY, weight_decay=0.1, lr=3e-3)
    config = module.configure_optimizers()
    decay, no_decay = config["optimizer"].param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    n_params = len(list(module.parameters()))
    assert len(decay["params"]) + len(no_decay["params"]) == n_params
    assert config["lr_scheduler"]["interval"] == "step"


def loaders(n_train: int, n_val: int, batch: int, t: int):
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (n_train + n_val, t + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    train = DataLoader(TensorDataset(x[:n_train], y[:n_train]), batch_size=batch)
    val = DataLoader(TensorDataset(x[n_train:], y[n_train:]), batch_size=batch)
    return train, val


def fit(module: MoELanguageModel, train, val) -> lightning.Trainer:
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train, val)
    return trainer


def test_lightning_module_trains_and_logs():
    torch.manual_seed(0)
    B, T, k = 4, 16, 2
    module = MoELanguageModel(**{**TINY, "top_k": k}, lr=3e-3, warmup_steps=2, max_steps=5)
    train, val = loaders(n_train=5 * B, n_val=6, batch=B, t=T)  # one epoch = 5 steps, val batches 4 + 2
    trainer = fit(module, train, val)
    metrics = trainer.callback_metrics

    assert trainer.global_step == 5
    for key in ("train/loss", "train/aux_loss", "train/z_loss", "train/tokens", "train/expert_balance"):
        assert key in metrics and torch.isfinite(metrics[key]), key
    assert metrics["train/tokens"].item() == 5 * B * T
    assert module.tokens_seen == 5 * B * T
    assert metrics["train/expert_balance"].item() >= 1.0

    # val/loss is the token-weighted mean cross entropy over the whole validation set.
    assert metrics["val/ppl"].item() == pytest.approx(math.exp(metrics["val/loss"].item()), rel=1e-5)
    module.eval()
    with torch.no_grad():
        total, n = 0.0, 0
        for x, y in val:
            logits, _ = module(x)
            total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            n += y.numel()
    assert metrics["val/loss"].item() == pytest.approx(total / n, rel=1e-5)

    # Expert accounting.
    assert module.last_expert_counts.shape == (2, 4)
    assert module.last_expert_counts.sum(dim=1).tolist() == [B * T * k] * 2
    counts = module.island_token_counts()
    names = dict(module.named_parameters())
    assert len(counts) == 2 * 3
    for name, per_expert in counts.items():
        assert name in names and name.startswith("model.blocks.")
        assert name.rsplit(".", 1)[1] in ("w_gate", "w_up", "w_down")
        assert per_expert.shape == (4,) and per_expert.dtype == torch.float64
        assert per_expert.sum().item() == 5 * B * T * k
    assert torch.equal(counts["model.blocks.0.mlp.w_up"], counts["model.blocks.0.mlp.w_down"])
    module.reset_island_token_counts()
    assert all(v.sum().item() == 0 for v in module.island_token_counts().values())

    assert module.num_parameters() == count_parameters(module.model)
    assert module.tokens_per_batch((torch.zeros(3, 7), torch.zeros(3, 7))) == 21
    assert module.hparams.d_model == TINY["d_model"]


def test_lightning_dense_module_trains():
    torch.manual_seed(0)
    module = MoELanguageModel(**{**TINY, "n_experts": 0}, warmup_steps=1, max_steps=5)
    train, val = loaders(n_train=20, n_val=4, batch=4, t=16)
    trainer = fit(module, train, val)
    metrics = trainer.callback_metrics
    assert "train/expert_balance" not in metrics
    assert metrics["train/aux_loss"].item() == 0.0
    assert torch.isfinite(metrics["val/loss"]) and "val/ppl" in metrics
    assert module.island_token_counts() == {}
    assert module.last_expert_counts.shape == (0, 0)


def test_training_reduces_loss_on_a_repetitive_sequence():
    """A few optimiser steps on one fixed batch must lower the loss (the model can learn)."""
    torch.manual_seed(0)
    module = MoELanguageModel(**TINY, lr=1e-2, warmup_steps=1, max_steps=30)
    optimizer = module.configure_optimizers()["optimizer"]
    x = torch.arange(33).repeat(4, 1) % 7
    batch = (x[:, :-1], x[:, 1:])
    first = None
    for _ in range(30):
        ce, aux = module._losses(batch)
        loss = ce + 0.01 * aux["aux_loss"] + 0.001 * aux["z_loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = ce.item() if first is None else first
    assert ce.item() < 0.5 * first
