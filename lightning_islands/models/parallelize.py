"""Tensor and expert parallelism for :class:`~lightning_islands.models.moe.MoETransformer`.

``parallelize_moe`` turns a model, in place, into this rank's part of a model spread over two
1-D meshes:

- tensor parallel (TP): the ranks see the same tokens; each holds a slice of every attention and
  feed-forward projection, experts included (whole heads, a slice of d_ff) and the pieces meet in
  all-reduces;
- expert parallel (EP): the ranks see their own tokens; each holds whole experts of every MoE
  layer, and the MoE layers send each token to the rank that owns its expert (all-to-all).

Data parallelism (FSDP2 over a third mesh) comes afterwards, from the caller, and must leave the
parameters that ``parallelize_moe`` returns alone. Plain PyTorch: no Lightning here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

if TYPE_CHECKING:  # moe.py imports this module
    from lightning_islands.models.moe import MoEConfig, MoETransformer

__all__ = ["check_parallel_sizes", "parallelize_moe"]


def parallelize_moe(model: MoETransformer, tp_mesh: DeviceMesh | None, ep_mesh: DeviceMesh | None) -> set[nn.Parameter]:
    """Apply tensor parallelism over ``tp_mesh`` and expert parallelism over ``ep_mesh``, in place.

    Each mesh is 1-D; ``None`` or a mesh of one rank leaves that kind of parallelism off.

    TP splits attention ``wq``/``wk``/``wv`` by output columns (whole heads) and ``proj`` by input
    rows; likewise ``w_gate``/``w_up`` and ``w_down`` of the dense SwiGLU and of the MoE layers'
    shared expert, and every expert's SwiGLU along d_ff (``w_gate``/``w_up`` [E, D, F] on dim 2,
    ``w_down`` [E, F, D] on dim 1: each rank runs every expert on its slice, and the partial
    outputs are summed). Modules take and return plain tensors, replicated over the TP ranks. The
    embedding, norms, LM head (tied to the embedding) and routers stay whole.

    EP gives each rank ``n_experts / ep`` whole experts of every MoE layer (``w_gate``, ``w_up``,
    ``w_down`` become DTensors sharded on dim 0, scattered from the mesh's first rank: call this
    after the weights are initialised or loaded).

    Returns the expert weights under EP, else an empty set: their gradients are complete (the
    data-parallel average) after backward, so FSDP must neither shard nor reduce them
    (``fully_shard(..., ignored_params=...)``).
    """
    tp = _size(tp_mesh)
    ep = _size(ep_mesh)
    check_parallel_sizes(model.cfg, tp, ep)

    if tp > 1:
        for block in model.blocks:
            columns = {name: ColwiseParallel() for name in ("wq", "wk", "wv")}
            parallelize_module(block.attn, tp_mesh, {**columns, "proj": RowwiseParallel()})
            dense = block.mlp.shared if block.is_moe else block.mlp
            if dense is not None:
                swiglu = {"w_gate": ColwiseParallel(), "w_up": ColwiseParallel(), "w_down": RowwiseParallel()}
                parallelize_module(dense, tp_mesh, swiglu)
            if block.is_moe:  # every expert split along d_ff, as the dense SwiGLU is
                for name, dim in (("w_gate", 2), ("w_up", 2), ("w_down", 1)):
                    weight = getattr(block.mlp, name).detach()
                    setattr(block.mlp, name, nn.Parameter(distribute_tensor(weight, tp_mesh, [Shard(dim)])))
                block.mlp.tp_mesh = tp_mesh

    experts: set[nn.Parameter] = set()
    if ep > 1 and model.cfg.n_moe_layers > 0:
        _check_all_to_all(ep_mesh)
        for block in model.blocks:
            if block.is_moe:
                layer = block.mlp
                for name in ("w_gate", "w_up", "w_down"):
                    weight = nn.Parameter(distribute_tensor(getattr(layer, name).detach(), ep_mesh, [Shard(0)]))
                    setattr(layer, name, weight)
                    experts.add(weight)
                layer.ep_mesh = ep_mesh
    return experts


def check_parallel_sizes(cfg: MoEConfig, tp: int, ep: int) -> None:
    """Raise ``ValueError`` when the model cannot be split ``tp`` ways or its experts ``ep`` ways."""
    if cfg.n_heads % tp:
        raise ValueError(
            f"tensor parallelism over {tp} ranks splits whole attention heads, but n_heads={cfg.n_heads} "
            f"is not divisible by {tp}: choose a tensor-parallel size that divides n_heads"
        )
    if cfg.d_ff % tp:
        raise ValueError(
            f"tensor parallelism over {tp} ranks splits the SwiGLU width, but d_ff={cfg.d_ff} is not "
            f"divisible by {tp}: choose a tensor-parallel size that divides d_ff"
        )
    if cfg.n_experts % ep:
        raise ValueError(
            f"expert parallelism over {ep} ranks gives each rank whole experts, but n_experts={cfg.n_experts} "
            f"is not divisible by {ep}: choose an expert-parallel size that divides n_experts"
        )


def _size(mesh: DeviceMesh | None) -> int:
    if mesh is None:
        return 1
    if mesh.ndim != 1:
        raise ValueError(f"parallelize_moe takes 1-D meshes, got one of shape {tuple(mesh.shape)}: pass mesh[dim_name]")
    return mesh.size()


def _check_all_to_all(mesh: DeviceMesh) -> None:
    """Expert parallelism exchanges tokens with all-to-all: fail now if the backend has none."""
    group = mesh.get_group()
    probe = torch.zeros(mesh.size(), dtype=torch.long, device=mesh.device_type)
    try:
        dist.all_to_all_single(torch.empty_like(probe), probe, group=group)
    except (RuntimeError, NotImplementedError) as err:
        raise RuntimeError(
            f"expert parallelism needs all-to-all, which the {dist.get_backend(group)!r} backend does not "
            "provide here: use a backend with all_to_all_single (NCCL on GPUs, gloo on CPUs)"
        ) from err
