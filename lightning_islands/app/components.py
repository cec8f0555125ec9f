"""What the job's config builds around the model: loggers and callbacks (``_target_`` nodes, as Hydra
users write them), the Trainer's keywords, and the centralized baseline's batch.

- ``logger.NAME`` / ``callbacks.NAME``: each a node with a ``_target_`` (a Lightning logger or
  callback class), instantiated in every island's process; ``${li:island}``, ``${li:run_dir}`` and
  ``${li:launch}`` in them resolve there (:mod:`~lightning_islands.app.placeholders`).
- ``trainer.*``: every key is a keyword of ``lightning.pytorch.Trainer`` except the app's own
  (:data:`APP_TRAINER_KEYS`) and those the app sets (:data:`SET_BY_THE_APP`); a key that is neither
  is refused before anything starts.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_islands.app import placeholders

# trainer.* keys the app reads itself (checkpoint callbacks)
APP_TRAINER_KEYS = ("checkpoint_every_n_steps", "checkpoint_every_n_rounds", "keep_round_checkpoints")
# Trainer keywords the app sets, and where to set what they control instead
SET_BY_THE_APP = {
    "devices": "islands.members[i].devices (strategy=islands) or strategy.devices",
    "num_nodes": "one island is one torch.distributed world; its processes come from islands.members[i].devices",
    "strategy": "the strategy group (strategy=islands, fsdp, ddp or single)",
    "logger": "the logger group (logger=csv, or +logger.NAME={_target_: ...})",
    "callbacks": "+callbacks.NAME={_target_: ...}",
    "use_distributed_sampler": "the data module shards by island and rank itself",
    "enable_checkpointing": "the app always writes last.ckpt and final.ckpt; trainer.checkpoint_every_n_steps=0 "
                            "and trainer.checkpoint_every_n_rounds=0 write no others",
    "barebones": "the app needs checkpoints and loggers; drop it",
}


def _nodes(cfg: DictConfig, key: str) -> list[tuple[str, Any]]:
    group = cfg.get(key) or {}
    if not isinstance(group, Mapping):
        raise ValueError(f"{key} must map names to nodes with a _target_, e.g. "
                         f"+{key}.NAME={{_target_: ...}}; got {group!r}")
    nodes = []
    for name, node in group.items():
        if node is None:  # switched off with key.NAME=null
            continue
        if not isinstance(node, Mapping) or "_target_" not in node:
            raise ValueError(f"{key}.{name} has no _target_: give the class to build, e.g. "
                             f"+{key}.{name}={{_target_: lightning.pytorch.callbacks.LearningRateMonitor}}")
        try:
            get_object(str(node["_target_"]))
        except Exception as err:  # Hydra wraps the import error in its own
            raise ValueError(f"{key}.{name}._target_={node['_target_']} cannot be imported ({err}); check the "
                             "dotted path and that its package is installed") from None
        nodes.append((str(name), node))
    return nodes


def launch_name(run_dir: Path) -> str:
    """One name per launch: the run folder's, prefixed by its sweep's for a multirun job (whose own
    folder is just its number)."""
    return f"{run_dir.parent.name}-{run_dir.name}" if run_dir.name.isdigit() else run_dir.name


def fill_placeholders(island: int, run_dir: Path) -> None:
    """This process's ``${li:island}``, ``${li:run_dir}`` and ``${li:launch}``."""
    placeholders.fill(island=island, run_dir=str(run_dir), launch=launch_name(run_dir))


def build_loggers(cfg: DictConfig, run_dir: Path, island: int) -> list[Any]:
    """Every ``logger.NAME`` node, built for ``island`` (W&B: offline when the node says so, the job
    as its config)."""
    fill_placeholders(island, run_dir)
    loggers = []
    for _, node in _nodes(cfg, "logger"):
        spec = OmegaConf.to_container(node, resolve=True)
        if str(spec["_target_"]).endswith("WandbLogger"):  # type: ignore[index]
            if spec.get("offline", False):  # type: ignore[union-attr]
                os.environ.setdefault("WANDB_MODE", "offline")
            spec["config"] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[index]
        loggers.append(instantiate(spec, _recursive_=False, _convert_="all"))  # the job in config stays data
    return loggers


def build_callbacks(cfg: DictConfig) -> list[pl.Callback]:
    """Every ``callbacks.NAME`` node, built (after :func:`build_loggers` filled the placeholders)."""
    return [instantiate(node) for _, node in _nodes(cfg, "callbacks")]


def trainer_options(trainer: Mapping[str, Any]) -> dict[str, Any]:
    """The Trainer keywords of ``trainer.*`` (``null`` ones left to the Trainer's defaults)."""
    return {k: v for k, v in trainer.items() if k not in APP_TRAINER_KEYS and v is not None}


def check_job(cfg: DictConfig) -> None:
    """The job's trainer keys, loggers and callbacks, checked before anything starts (a ValueError
    names the key and the fix)."""
    accepted = set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}
    for key in trainer_options(cfg.get("trainer") or {}):
        if key in SET_BY_THE_APP:
            raise ValueError(f"trainer.{key} is set by the app; use {SET_BY_THE_APP[key]}")
        if key not in accepted:
            raise ValueError(f"trainer.{key} is not a keyword of lightning.pytorch.Trainer (nor a key of the app: "
                             f"{', '.join(APP_TRAINER_KEYS)}); check its spelling")
    _nodes(cfg, "logger")
    _nodes(cfg, "callbacks")


def centralized_batch(cfg: DictConfig) -> int:
    """The per-process batch at which ``strategy.devices`` processes train, in one step, as many
    windows as one step of all islands of ``islands.members`` together (``strategy.match_islands``)."""
    windows = sum(int(m.devices) // int(m.get("tensor_parallel_size") or 1)
                  * int(m.get("batch_size") or cfg.data.batch_size) for m in cfg.islands.members)
    data_parallel = int(cfg.strategy.get("devices", 1)) // int(cfg.strategy.get("tensor_parallel_size") or 1)
    if windows % data_parallel:
        raise ValueError(f"strategy.match_islands: the islands train {windows} windows a step, which "
                         f"{data_parallel} data-parallel processes cannot share evenly; set strategy.devices to "
                         f"a divisor of {windows}")
    return windows // data_parallel
