"""lightning_islands: train one model across compute islands with PyTorch Lightning.

FSDP2 inside each island, DiLoCo-style quantized outer steps between islands.

Importing the package imports nothing else: :class:`IslandStrategy`, :class:`FSDP2Strategy`,
:class:`RoundCheckpoint` and :class:`IslandSettings` load on first use, so that the
``lightning-islands`` command, the engine and the planner start without Lightning. Importing
:mod:`lightning_islands.strategy` (also by using ``lightning_islands.IslandStrategy``) registers
the ``"islands"`` strategy name with Lightning, :mod:`lightning_islands.fsdp` the ``"fsdp2"`` one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_islands.callbacks import RoundCheckpoint
    from lightning_islands.engine.settings import IslandSettings
    from lightning_islands.fsdp import FSDP2Strategy
    from lightning_islands.strategy import IslandStrategy

__version__ = "0.1.0"
__all__ = ["FSDP2Strategy", "IslandSettings", "IslandStrategy", "RoundCheckpoint", "__version__"]

_HOMES = {"FSDP2Strategy": "lightning_islands.fsdp", "IslandSettings": "lightning_islands.engine.settings",
          "IslandStrategy": "lightning_islands.strategy", "RoundCheckpoint": "lightning_islands.callbacks"}


def __getattr__(name: str) -> Any:
    """The public classes, each imported from its module on first use (PEP 562)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'lightning_islands' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
