"""Where the outer state goes in a checkpoint: a torch distributed checkpoint beside the module's.

Each rank's shards of the anchors, the outer momentum, the error-feedback residual and (with the
butterfly topology) the bases of its stages are saved
as DTensors placed like the module's parameters (under their names), so an island's checkpoint
holds them as it holds the parameters, and a resumed island of the same shape gets its own shards
back. The folder is ``islands_outer/`` inside the checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from lightning_islands.engine.layout import CanonicalLayout

OUTER_DIR = "islands_outer"
STATE_KEYS = ("anchor", "momentum", "residual")


def _as_dtensors(tensors: Sequence[Tensor], params: Sequence[Tensor], layout: CanonicalLayout) -> dict[str, Tensor]:
    """This rank's shards by parameter name, as DTensors placed like ``params`` where those are."""
    from torch.distributed.tensor import DTensor

    return {e.name: DTensor.from_local(t.to(p.device), p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride()) if isinstance(p, DTensor) else t
            for e, p, t in zip(layout.entries, params, tensors)}


def save_outer_state(checkpoint: Path, state: dict, params: Sequence[Tensor], layout: CanonicalLayout) -> None:
    """Save the tensor lists of ``state`` (an :meth:`OuterState.state_dict`; ``None`` entries are
    skipped) into ``checkpoint/islands_outer``; a collective of the island."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    keys = [*STATE_KEYS, *(k for k in state if k.startswith("base"))]  # the butterfly's bases too
    tensors = {k: _as_dtensors(state[k], params, layout) for k in keys if state.get(k) is not None}
    dcp_save(tensors, storage_writer=FileSystemWriter(checkpoint / OUTER_DIR, overwrite=True))


def load_outer_state(checkpoint: Path, keys: Sequence[str], params: Sequence[Tensor], layout: CanonicalLayout,
                     like: Sequence[Tensor]) -> dict[str, list[Tensor]]:
    """The tensor lists ``keys`` from ``checkpoint/islands_outer``: this rank's shards, fp32, shaped
    like ``like``; a collective of the island. A missing or damaged folder is a RuntimeError that
    names it and the fix."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
    from torch.distributed.tensor import DTensor

    state = {k: _as_dtensors([torch.zeros_like(t, dtype=torch.float32) for t in like], params, layout) for k in keys}
    try:
        dcp_load(state, checkpoint_id=checkpoint / OUTER_DIR)
    except (Exception, CheckpointException) as err:
        raise RuntimeError(f"could not read the islands' outer state from {checkpoint / OUTER_DIR} ({err}); the "
                           "checkpoint is incomplete or damaged: resume from an earlier one") from err
    return {k: [t.to_local() if isinstance(t, DTensor) else t for t in (state[k][e.name] for e in layout.entries)]
            for k in keys}


def load_global_parameters(checkpoint: Path, params: Sequence[Tensor], locals_: Sequence[Tensor],
                           layout: CanonicalLayout) -> None:
    """Copy the global parameters (the anchors) of an island's checkpoint into ``locals_``, this
    rank's shards of ``params``: to validate, test or predict with the global model."""
    with torch.no_grad():
        for loc, anchor in zip(locals_, load_outer_state(checkpoint, ["anchor"], params, layout, locals_)["anchor"]):
            loc.copy_(anchor)
