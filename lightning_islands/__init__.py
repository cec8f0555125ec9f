"""lightning_islands: train one model across compute islands with PyTorch Lightning.

FSDP2 inside each island, DiLoCo-style quantized outer steps between islands. Importing the package
registers the ``"fsdp2"`` and ``"islands"`` strategy names with Lightning.
"""

from lightning_islands.callbacks import RoundCheckpoint
from lightning_islands.engine.settings import IslandSettings
from lightning_islands.fsdp import FSDP2Strategy
from lightning_islands.fsdp import register as _register_fsdp2
from lightning_islands.strategy import IslandStrategy
from lightning_islands.strategy import register as _register_islands

__version__ = "0.1.0"
__all__ = ["FSDP2Strategy", "IslandSettings", "IslandStrategy", "RoundCheckpoint", "__version__"]

_register_fsdp2()
_register_islands()
