"""Ready-made Hydra experiments (``experiment=<name>``); installed as ``lightning_islands.recipes``."""
