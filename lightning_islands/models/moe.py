"""A small decoder-only byte-level transformer with Mixture-of-Experts feed-forward layers.

Layout (read top to bottom):

    MoEConfig            all hyper-parameters of the network
    rope_tables/apply_rope  rotary position embeddings
    CausalSelfAttention  multi-head attention with RoPE, via scaled_dot_product_attention
    SwiGLU               the dense feed-forward (also used as the optional shared expert)
    MoELayer             router + batched expert weights, top-k token-choice routing
                         (expert parallel once parallelize_moe gave it a device mesh)
    Block                pre-norm residual block: attention, then SwiGLU or MoE
    MoETransformer       embedding -> blocks (an nn.ModuleList) -> norm -> LM head
    count_parameters     total and per-token active parameter counts
    PRESETS              named sizes ("cpu", "gpu_small", "gpu", "1b")
    MoELanguageModel     the LightningModule: losses, logging, optimizer, expert token counts

The transformer itself is plain PyTorch; only ``MoELanguageModel`` depends on Lightning.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, fields
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torchmetrics import MeanMetric

from lightning_islands.models.parallelize import parallelize_moe

__all__ = [
    "PRESETS",
    "Block",
    "CausalSelfAttention",
    "MoEConfig",
    "MoELanguageModel",
    "MoELayer",
    "MoETransformer",
    "SwiGLU",
    "apply_rope",
    "count_parameters",
    "lr_schedule",
    "rope_tables",
]


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


@dataclass
class MoEConfig:
    """Hyper-parameters of :class:`MoETransformer`.

    ``n_experts=0`` gives a dense model (a SwiGLU MLP in every layer). Otherwise layer ``i``
    (0-based) is a MoE layer when ``i % moe_every == moe_every - 1``: every layer for
    ``moe_every=1``, layers 1, 3, 5, ... for ``moe_every=2``.
    """

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_experts: int = 8
    top_k: int = 2
    d_ff: int = 256
    shared_expert: bool = False
    moe_every: int = 1
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    tie_embeddings: bool = True
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2 != 0:
            raise ValueError("the head dimension d_model // n_heads must be even for rotary embeddings")
        if self.n_experts < 0:
            raise ValueError("n_experts must be >= 0 (0 means dense)")
        if self.n_experts > 0 and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
        if self.moe_every < 1:
            raise ValueError("moe_every must be >= 1")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block number ``layer`` (0-based) uses a MoE feed-forward."""
        return self.n_experts > 0 and layer % self.moe_every == self.moe_every - 1

    @property
    def n_moe_layers(self) -> int:
        """Number of MoE blocks."""
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))


# --------------------------------------------------------------------------------------------------
# Rotary position embeddings
# --------------------------------------------------------------------------------------------------


def rope_tables(head_dim: int, seq_len: int, base: float, device: Any = None) -> tuple[Tensor, Tensor]:
    """cos and sin tables of shape [seq_len, head_dim // 2] (float32)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[..., i], x[..., i + D/2]) of x [B, H, T, D] by position-dependent angles."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with rotary positions."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        # Separate q, k, v projections so that a column-wise tensor-parallel split keeps whole heads.
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # [B, T, H*hd] -> [B, H, T, hd]; H is the local head count under tensor parallelism.
        n_heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(B, T, n_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, n_heads * self.head_dim))


class SwiGLU(nn.Module):
    """Dense SwiGLU feed-forward: w_down(silu(w_gate x) * w_up x)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class MoELayer(nn.Module):
    """Top-k token-choice Mixture of SwiGLU experts.

    Expert weights are batched parameters (``w_gate``/``w_up``: [E, d_model, d_ff], ``w_down``:
    [E, d_ff, d_model]). Each token picks its ``top_k`` experts from a softmax over router logits;
    the k picked probabilities are renormalised to sum to 1 and weight the expert outputs.

    ``forward`` returns ``(output, stats)`` where ``stats`` holds this layer's load-balancing loss
    ``aux_loss`` (E * sum_e f_e * P_e: 1.0 for uniform routing), ``z_loss`` (mean squared
    logsumexp of the router logits) and ``counts`` (LongTensor [E], assignments per expert).

    Note: with ``top_k=1`` the renormalised weight is always 1, so the router then learns only
    from the auxiliary losses.
    """

    def __init__(self, cfg: MoEConfig, moe_index: int = 0) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.moe_index = moe_index  # position of this layer among the model's MoE layers
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model, cfg.d_ff))
        self.w_up = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model, cfg.d_ff))
        self.w_down = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_ff, cfg.d_model))
        self.shared = SwiGLU(cfg.d_model, cfg.d_ff) if cfg.shared_expert else None
        # Expert parallelism (set by parallelize_moe): the expert weights are DTensors sharded over
        # this 1-D mesh, each rank owning whole experts.
        self.ep_mesh: DeviceMesh | None = None
        # Tensor parallelism (set by parallelize_moe): every expert's weights split along d_ff.
        self.tp_mesh: DeviceMesh | None = None

    def forward(self, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, D]
        n_tokens, E, k = x.shape[0], self.n_experts, self.top_k

        # Routing (in at least float32).
        logits = self.router(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # [N, E]
        probs = logits.softmax(dim=-1)
        top_w, top_e = probs.topk(k, dim=-1)  # [N, k]
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)

        # One row per (token, choice), sorted by expert so that each expert's rows are contiguous.
        expert_of = top_e.reshape(-1)  # [N*k]
        order = torch.argsort(expert_of, stable=True)
        token_of = torch.arange(n_tokens, device=x.device).repeat_interleave(k)[order]
        weight_of = top_w.reshape(-1)[order]
        counts = torch.bincount(expert_of, minlength=E)  # [E]

        if self.ep_mesh is not None:
            h = self._experts_parallel(x[token_of], counts)
        elif self.tp_mesh is not None:
            h = self._experts_tensor_parallel(x[token_of], counts)
        else:
            h = _experts_swiglu(x[token_of], counts, self.w_gate, self.w_up, self.w_down)
        y = h * weight_of.unsqueeze(-1)  # [N*k, D]
        out = x.new_zeros(x.shape).index_add(0, token_of, y.to(x.dtype))
        if self.shared is not None:
            out = out + self.shared(x)

        # Auxiliary losses. f_e: share of the N*k assignments (not differentiable),
        # P_e: mean router probability (differentiable).
        f = counts.to(probs.dtype) / (n_tokens * k)
        p = probs.mean(dim=0)
        stats = {
            "aux_loss": E * torch.sum(f * p),
            "z_loss": torch.logsumexp(logits, dim=-1).square().mean(),
            "counts": counts,
        }
        return out.reshape(shape), stats

    def _experts_tensor_parallel(self, rows: Tensor, counts: Tensor) -> Tensor:
        """Tensor-parallel :func:`_experts_swiglu`: each rank runs every expert on its slice of
        d_ff and the partial outputs are summed over the group (the rows' gradients too)."""
        from torch.distributed.tensor import DTensor, Partial, Replicate

        mesh = self.tp_mesh
        rows = DTensor.from_local(rows, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
        part = _experts_swiglu(rows, counts, self.w_gate.to_local(), self.w_up.to_local(), self.w_down.to_local())
        return DTensor.from_local(part, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    def _experts_parallel(self, rows: Tensor, counts: Tensor) -> Tensor:
        """Expert-parallel :func:`_experts_swiglu`: each row goes to the rank owning its expert and
        its result comes back. The expert gradients, which sum every rank's rows, are divided by
        the group size so that they equal the data-parallel average of the ranks' gradients."""
        group, ep = self.ep_mesh.get_group(), self.ep_mesh.size()
        weights = [_ScaleGrad.apply(w.to_local(), 1.0 / ep) for w in (self.w_gate, self.w_up, self.w_down)]
        n_local = weights[0].shape[0]  # experts owned here: rank r owns [r * n_local, (r + 1) * n_local)
        received_counts = torch.empty_like(counts)  # [ep * n_local]: rows from rank r for local expert e
        dist.all_to_all_single(received_counts, counts, group=group)
        send = counts.view(ep, n_local).sum(1).tolist()
        recv = received_counts.view(ep, n_local).sum(1).tolist()
        received = all_to_all_single_autograd(rows, recv, send, group)
        # The rows arrive by source rank, then expert; sort them by expert (and back afterwards).
        local_expert = torch.arange(n_local, device=rows.device).repeat(ep).repeat_interleave(received_counts)
        order = torch.argsort(local_expert, stable=True)
        h = _experts_swiglu(received[order], received_counts.view(ep, n_local).sum(0), *weights)
        return all_to_all_single_autograd(h[torch.argsort(order)], send, recv, group)


def _experts_swiglu(rows: Tensor, counts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """Each expert's SwiGLU on its own rows: ``rows`` [sum(counts), D] are sorted by expert,
    ``counts[e]`` of them for expert ``e`` (weights [E, ...] as in :class:`MoELayer`)."""
    # unbind() (rather than indexing the weights E times) keeps the backward pass to a single
    # gradient buffer per weight.
    w_gate, w_up, w_down = w_gate.unbind(0), w_up.unbind(0), w_down.unbind(0)
    segments = torch.split(rows, counts.tolist())
    return torch.cat([(F.silu(seg @ w_gate[e]) * (seg @ w_up[e])) @ w_down[e] for e, seg in enumerate(segments)])


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + ffn(norm(x)) (SwiGLU or MoE)."""

    def __init__(self, cfg: MoEConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(layer)
        if self.is_moe:
            moe_index = sum(cfg.is_moe_layer(i) for i in range(layer))
            self.mlp: nn.Module = MoELayer(cfg, moe_index)
        else:
            self.mlp = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, dict[str, Tensor] | None]:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        if self.is_moe:
            h, stats = self.mlp(self.mlp_norm(x))
        else:
            h, stats = self.mlp(self.mlp_norm(x)), None
        return x + h, stats


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


class MoETransformer(nn.Module):
    """Decoder-only transformer; ``forward(idx) -> (logits, aux)``.

    ``aux`` has ``aux_loss`` and ``z_loss`` (averaged over MoE layers, so a perfectly balanced
    model reports ``aux_loss == 1.0`` regardless of depth) and ``expert_counts``
    (LongTensor [n_moe_layers, n_experts]). A dense model returns zero losses and a (0, 0) tensor.

    The blocks live in the ``nn.ModuleList`` ``self.blocks`` so that FSDP2 can shard block by
    block. To build on the meta device and materialise later: ``model.to_empty(device=...)``
    followed by ``model.init_weights()`` (which also recomputes the rotary tables).
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layers)])
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        cos, sin = rope_tables(cfg.d_model // cfg.n_heads, cfg.seq_len, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialise all parameters and the rotary tables in place.

        Weights ~ N(0, init_std); the projections that write into the residual stream
        (attention ``proj`` and the feed-forward ``w_down``) use init_std / sqrt(2 * n_layers).
        Also re-ties the LM head to the embedding if ``to_empty()`` separated them; call it
        before wrapping with a sharding strategy.
        """
        cfg = self.cfg
        if cfg.tie_embeddings and self.lm_head.weight is not self.tok_emb.weight:
            self.lm_head.weight = self.tok_emb.weight  # Module.to_empty() unties shared parameters
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        for name, p in self.named_parameters():
            if p.ndim < 2:  # RMSNorm weights
                nn.init.ones_(p)
            elif name.endswith(("proj.weight", "w_down.weight", "w_down")):
                nn.init.normal_(p, mean=0.0, std=out_std)
            else:
                nn.init.normal_(p, mean=0.0, std=std)
        cos, sin = rope_tables(cfg.d_model // cfg.n_heads, cfg.seq_len, cfg.rope_base, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, idx: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds seq_len={self.cfg.seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_emb(idx)
        stats = []
        for block in self.blocks:
            x, s = block(x, cos, sin)
            if s is not None:
                stats.append(s)
        logits = self.lm_head(self.norm(x))

        if stats:
            aux = {
                "aux_loss": torch.stack([s["aux_loss"] for s in stats]).mean(),
                "z_loss": torch.stack([s["z_loss"] for s in stats]).mean(),
                "expert_counts": torch.stack([s["counts"] for s in stats]),
            }
        else:
            zero = torch.zeros((), device=idx.device)
            aux = {
                "aux_loss": zero,
                "z_loss": zero.clone(),
                "expert_counts": torch.zeros(0, 0, dtype=torch.long, device=idx.device),
            }
        return logits, aux


def count_parameters(model: nn.Module) -> dict[str, int]:
    """``total`` parameters (tied weights once) and ``active`` parameters per token.

    Active excludes, in every MoE layer, the ``n_experts - top_k`` experts a token does not use.
    Works on meta-device and sharded (DTensor) models, which report their global sizes.
    """
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for m in model.modules():
        if isinstance(m, MoELayer):
            per_expert = (m.w_gate.numel() + m.w_up.numel() + m.w_down.numel()) // m.n_experts
            inactive += (m.n_experts - m.top_k) * per_expert
    return {"total": total, "active": total - inactive}


# --------------------------------------------------------------------------------------------------
# Size presets (MoEConfig keyword arguments). Counts from count_parameters (byte vocabulary, tied).
# --------------------------------------------------------------------------------------------------

PRESETS: dict[str, dict[str, Any]] = {
    # total 3,445,888 / active 1,086,592: a few minutes of useful training on 2 CPU cores.
    "cpu": dict(seq_len=128, d_model=128, n_layers=4, n_heads=4, n_experts=8, top_k=2, d_ff=256),
    # total 31,972,224 / active 10,738,560: ten times the CPU preset's active parameters, for the
    # quality benchmark's GPU setting (several short runs share one GPU).
    "gpu_small": dict(seq_len=256, d_model=384, n_layers=6, n_heads=6, n_experts=8, top_k=2, d_ff=512),
    # total 148,998,912 / active 49,908,480: one GPU.
    "gpu": dict(
        seq_len=1024,
        d_model=768,
        n_layers=12,
        n_heads=12,
        n_experts=16,
        top_k=2,
        d_ff=256,
        shared_expert=True,
    ),
    # total 1,020,274,176 / active 326,641,152.
    "1b": dict(seq_len=2048, d_model=1536, n_layers=24, n_heads=12, n_experts=16, top_k=2, d_ff=448),
}


# --------------------------------------------------------------------------------------------------
# LightningModule
# --------------------------------------------------------------------------------------------------

# val/loss and val/ppl are logged from on_validation_epoch_end after torchmetrics has already
# synchronised them across processes; Lightning would otherwise suggest sync_dist=True for them.
warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\('val/(loss|ppl)'")


def lr_schedule(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warm-up to 1 over ``warmup_steps``, then cosine to ``min_lr_ratio``
    at ``max_steps`` (and constant after)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class MoELanguageModel(pl.LightningModule):
    """Next-byte language model around :class:`MoETransformer`.

    Batches are ``(x, y)`` LongTensors [B, T]. The training loss is
    ``cross_entropy + aux_loss_coef * aux_loss + z_loss_coef * z_loss``.
    ``island_token_counts()`` reports how many tokens each expert processed since the last
    ``reset_island_token_counts()``, keyed by the experts' parameter names.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 128,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        n_experts: int = 8,
        top_k: int = 2,
        d_ff: int = 256,
        shared_expert: bool = False,
        moe_every: int = 1,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.001,
        tie_embeddings: bool = True,
        rope_base: float = 10000.0,
        norm_eps: float = 1e-5,
        init_std: float = 0.02,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        max_steps: int = 1000,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = MoEConfig(**{f.name: getattr(self.hparams, f.name) for f in fields(MoEConfig)})
        self.model = MoETransformer(self.config)
        self.val_loss = MeanMetric()
        self.tokens_seen = 0
        self.last_expert_counts = torch.zeros(0, 0, dtype=torch.long)
        # tokens routed per expert since the last reset, [n_moe_layers, n_experts]
        cfg = self.config
        self._expert_tokens = torch.zeros(cfg.n_moe_layers, cfg.n_experts, dtype=torch.float64)

    # ---- helpers ---------------------------------------------------------------------------------

    def forward(self, idx: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        return self.model(idx)

    def parallelize(self, tp_mesh: DeviceMesh | None, ep_mesh: DeviceMesh | None) -> set[nn.Parameter]:
        """Tensor and expert parallelism in place (:func:`parallelize_moe`); returns the expert
        weights that data-parallel sharding (``fully_shard(..., ignored_params=...)``) must skip."""
        return parallelize_moe(self.model, tp_mesh, ep_mesh)

    def num_parameters(self) -> dict[str, int]:
        """Total and per-token active parameter counts of the network."""
        return count_parameters(self.model)

    @staticmethod
    def tokens_per_batch(batch: tuple[Tensor, Tensor]) -> int:
        """Number of target tokens in a batch."""
        return batch[1].numel()

    def _losses(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        x, y = batch
        logits, aux = self.model(x)
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        return ce, aux

    # ---- training --------------------------------------------------------------------------------

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        ce, aux = self._losses(batch)
        cfg = self.config
        loss = ce + cfg.aux_loss_coef * aux["aux_loss"] + cfg.z_loss_coef * aux["z_loss"]

        self.tokens_seen += self.tokens_per_batch(batch)
        counts = aux["expert_counts"].detach().cpu()
        self.last_expert_counts = counts
        log = dict(sync_dist=False, on_step=True, on_epoch=False)
        self.log("train/loss", ce.detach(), prog_bar=True, **log)
        self.log("train/aux_loss", aux["aux_loss"].detach(), **log)
        self.log("train/z_loss", aux["z_loss"].detach(), **log)
        self.log("train/tokens", float(self.tokens_seen), **log)
        if counts.numel() > 0:
            self._expert_tokens += counts.to(torch.float64)
            # Worst layer: every MoE layer routes the same N*k assignments, so the mean is shared.
            balance = counts.max().double() / counts.double().mean()
            self.log("train/expert_balance", balance.item(), **log)
        return loss

    # ---- validation ------------------------------------------------------------------------------

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        ce, _ = self._losses(batch)
        # Token-weighted mean; torchmetrics sums value*weight and weight across processes.
        self.val_loss.update(ce.detach(), weight=self.tokens_per_batch(batch))

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # synchronised across the process group by torchmetrics
        self.val_loss.reset()
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        self.log("val/ppl", torch.exp(loss), sync_dist=False)

    # ---- optimisation ----------------------------------------------------------------------------

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": hp.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=hp.lr,
            betas=tuple(hp.betas),
        )
        schedule = functools.partial(
            lr_schedule,
            warmup_steps=hp.warmup_steps,
            max_steps=hp.max_steps,
            min_lr_ratio=hp.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- expert token accounting -----------------------------------------------------------------

    def island_token_counts(self) -> dict[str, Tensor]:
        """Tokens routed to each expert since the last reset, per expert parameter.

        Maps the fully qualified name (as in ``self.named_parameters()``) of every MoE layer's
        ``w_gate``, ``w_up`` and ``w_down`` to a float64 CPU tensor [n_experts] with the number of
        (token, choice) assignments that expert received; each layer's entries sum to tokens * top_k.
        """
        result: dict[str, Tensor] = {}
        for prefix, module in self.named_modules():
            if isinstance(module, MoELayer):
                row = self._expert_tokens[module.moe_index]
                for w in ("w_gate", "w_up", "w_down"):
                    result[f"{prefix}.{w}"] = row.clone()
        return result

    def reset_island_token_counts(self) -> None:
        """Zero the per-expert token counts reported by :meth:`island_token_counts`."""
        self._expert_tokens.zero_()

    # ---- checkpointing ---------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))
