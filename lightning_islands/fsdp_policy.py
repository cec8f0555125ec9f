"""How a module is sharded with FSDP2 when it does not say so itself.

One readable function, in the spirit of torchtitan's ``parallelize_*``: every element of every
``nn.ModuleList`` that owns parameters becomes its own FSDP2 unit (for a transformer, one unit per
block); then each top-level child that still owns parameters (say ``self.model``, holding the
embeddings, final norm and a tied head) becomes a unit. The LightningModule itself is wrapped only
when it owns parameters directly: Lightning calls ``training_step``, not ``forward``, so FSDP2's
hooks must sit on the modules that ``training_step`` calls.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def default_units(module: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP2 units under the default policy: the parameterised elements of
    every ``nn.ModuleList`` (outermost lists first, nested lists are left inside their parent)."""
    units: list[nn.Module] = []
    claimed: set[int] = set()
    for sub in module.modules():
        if id(sub) in claimed:
            continue
        if isinstance(sub, (nn.ModuleList, nn.ModuleDict)):
            for child in (sub.values() if isinstance(sub, nn.ModuleDict) else sub):
                if any(True for _ in child.parameters()):
                    units.append(child)
                    claimed.update(id(m) for m in child.modules())
    return units


def _by_class_name(module: nn.Module, names: Iterable[str]) -> list[nn.Module]:
    wanted = set(names)
    units: list[nn.Module] = []
    claimed: set[int] = set()
    for sub in module.modules():
        if sub is module or id(sub) in claimed:
            continue
        if type(sub).__name__ in wanted:
            units.append(sub)
            claimed.update(id(m) for m in sub.modules())
    return units


def apply_fully_shard(
    module: nn.Module,
    mesh: DeviceMesh,
    unit_classes: Iterable[str] | None = None,
    reshard_after_forward: bool = True,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard ``module`` in place with FSDP2 ``fully_shard`` over ``mesh``.

    ``unit_classes`` names the module classes that become units (e.g. ``["Block"]``); ``None`` uses
    :func:`default_units`. Then every top-level child (other than module containers) that still owns
    unsharded parameters becomes a unit, and ``module`` itself only if parameters remain.
    ``ignored_params`` stay as they are (e.g. experts that expert parallelism already spread).
    Returns the module.
    """
    from torch.distributed.fsdp import fully_shard

    names = list(unit_classes) if unit_classes else []
    units = _by_class_name(module, names) if names else default_units(module)
    ignored = set(ignored_params or ())
    covered: set[int] = {id(p) for p in ignored}

    def shard(unit: nn.Module) -> None:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored or None)
        covered.update(id(p) for p in unit.parameters())

    for unit in units:
        shard(unit)
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            continue
        if any(id(p) not in covered for p in child.parameters()):
            shard(child)
    if any(id(p) not in covered for p in module.parameters()):
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored or None)
    return module


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether ``module`` (or a submodule) was already wrapped with FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def local_view(param: torch.Tensor) -> torch.Tensor:
    """The part of ``param`` this rank holds: the local shard of a DTensor, else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def clip_grad_norm_across_meshes(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients that live on different device meshes
    (tensor-parallel weights on a 2-D mesh next to FSDP2's 1-D one), which torch's own cannot stack:
    the norm of each mesh's gradients, as a plain tensor, then the total, then the clip, a mesh at
    a time. Returns the total norm."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    if not groups:
        return torch.zeros(())
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def reshard_all(module: nn.Module | None) -> None:
    """Free every FSDP2 unit's unsharded parameters, so that writes to the local shards are what the
    next forward uses (after a no-grad forward, or with ``reshard_after_forward=False``, FSDP2 may
    otherwise keep using its unsharded copy)."""
    if module is None:
        return
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
