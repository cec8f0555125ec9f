"""FSDP2 inside one world, for any LightningModule.

Lightning's ``ModelParallelStrategy`` runs FSDP2 on CPU (gloo) and CUDA (NCCL) but insists that the
module shards itself in ``configure_model``. :class:`FSDP2Strategy` keeps everything else of it and,
when the module has no ``configure_model``, applies :func:`~lightning_islands.fsdp_policy.apply_fully_shard`
per block instead, so an unchanged module trains with ``strategy="fsdp2"``.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_islands.fsdp_policy import apply_fully_shard, is_fully_sharded

_exit_hook_registered = False
_EXIT_GRACE_S = 0.1  # seconds the exit hook releases the GIL after destroying the world


def _destroy_world_at_exit() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # Release the GIL for a moment: a worker thread still holding a finished collective can take
    # it now and drop its tensors, instead of trying during finalization (see below).
    time.sleep(_EXIT_GRACE_S)


def destroy_world_at_exit() -> None:
    """Destroy the default process group when the interpreter exits (once per process).

    Lightning does this only for NCCL. With gloo, a worker thread of the process group can still
    hold the last reference to a finished collective when Python finalizes; its destructor then
    needs the GIL, the finalizing interpreter ends the thread, and the process aborts with SIGABRT
    ("terminate called without an active exception"). Destroying the group in an ``atexit``
    handler, before finalization, joins those threads first (torch releases the GIL for it).
    """
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_destroy_world_at_exit)
        _exit_hook_registered = True


class FSDP2Strategy(ModelParallelStrategy):
    """Fully sharded data parallel (FSDP2) over every process of the world.

    Args:
        unit_classes: class names of the submodules that become FSDP2 units (e.g. ``["Block"]``);
            ``None`` makes every parameterised element of every ``nn.ModuleList`` a unit.
        reshard_after_forward: FSDP2's ``reshard_after_forward`` (ZeRO-3 when ``True``).
        save_distributed_checkpoint: each rank writes its shard (a checkpoint folder) when ``True``.
        process_group_backend: ``"gloo"``/``"nccl"``; defaults by device.
        timeout: timeout of the world's collectives.
    """

    strategy_name = "fsdp2"

    def __init__(
        self,
        unit_classes: Sequence[str] | None = None,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.unit_classes = list(unit_classes) if unit_classes else None
        self.reshard_after_forward = reshard_after_forward

    @override
    def setup_environment(self) -> None:
        # One data-parallel dimension spanning the whole world (Lightning's "auto" would use nodes).
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
        if dist.is_initialized() and dist.get_backend() != "nccl":
            destroy_world_at_exit()

    def shard_module(self, module: pl.LightningModule) -> None:
        """Apply the wrapping policy unless the module shards itself or is already sharded."""
        if is_fully_sharded(module):
            return
        apply_fully_shard(
            module,
            self.device_mesh["data_parallel"],
            unit_classes=self.unit_classes,
            reshard_after_forward=self.reshard_after_forward,
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # Same sequence as ModelParallelStrategy.setup, with the wrapping policy in place of its
        # "you must override configure_model" error.
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.lightning_module is not None
        self.shard_module(self.lightning_module)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        pass


def register() -> None:
    """Make ``Trainer(strategy="fsdp2")`` resolve to :class:`FSDP2Strategy`."""
    if "fsdp2" not in StrategyRegistry:
        StrategyRegistry.register("fsdp2", FSDP2Strategy, description="FSDP2 with automatic per-block wrapping")
