"""FSDP2 inside one world, for any LightningModule, with tensor and expert parallelism on request.

Lightning's ``ModelParallelStrategy`` runs FSDP2 on CPU (gloo) and CUDA (NCCL) but insists that the
module shards itself in ``configure_model``. :class:`FSDP2Strategy` keeps everything else of it and,
when the module has no ``configure_model``, applies :func:`~lightning_islands.fsdp_policy.apply_fully_shard`
per block instead, so an unchanged module trains with ``strategy="fsdp2"``. With
``tensor_parallel_size`` or ``expert_parallel_size`` above 1 the module first parallelizes itself
(its ``parallelize(tp_mesh, ep_mesh)``), then FSDP2 shards it over the data-parallel ranks.
"""

from __future__ import annotations

import atexit
import gc
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_islands.fsdp_policy import apply_fully_shard, clip_grad_norm_across_meshes, is_fully_sharded

_exit_hook_registered = False
_EXIT_GRACE_S = 0.1  # seconds the exit hook releases the GIL after destroying the world


def destroy_world() -> None:
    """Destroy the default process group (every group), then give gloo's worker threads a moment
    to let go of their last collectives (see :func:`destroy_world_at_exit`)."""
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

    Then the objects alive at exit are frozen (:func:`gc.freeze`): finalization's last garbage
    collection skips the million objects importing torch and Lightning made, about a second of
    CPU less per process (the modules are still torn down, their objects still released by
    reference count).
    """
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(gc.freeze)  # handlers run last-registered first: this one after destroy_world
        atexit.register(destroy_world)
        _exit_hook_registered = True


def init_restarted_world(backend: str, timeout: timedelta) -> None:
    """In a restarted life of a torchelastic worker group (``TORCHELASTIC_RESTART_COUNT`` > 0), start
    the default process group on the agent's store under a prefix of this life's own.

    torchrun's static rendezvous keeps one store for every restart and the default group's keys carry
    no restart count, so a rank of the new life could read a dead rank's gloo address there and fail to
    connect ("Connection refused", about half the restarts of a two-process island under load).
    Lightning then finds the group started and keeps it. The first life, and a world not started by
    torchelastic's agent, are left to Lightning."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if not restart or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else None
    dist.init_process_group(backend, store=dist.PrefixStore(f"lightning_islands/life{restart}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout,
                            device_id=device)
    destroy_world_at_exit()  # what Lightning registers when it starts the group itself


class FSDP2Strategy(ModelParallelStrategy):
    """Fully sharded data parallel (FSDP2) over every process of the world.

    Args:
        unit_classes: class names of the submodules that become FSDP2 units (e.g. ``["Block"]``);
            ``None`` makes every parameterised element of every ``nn.ModuleList`` a unit.
        reshard_after_forward: FSDP2's ``reshard_after_forward`` (ZeRO-3 when ``True``).
        save_distributed_checkpoint: each rank writes its shard (a checkpoint folder) when ``True``.
        process_group_backend: ``"gloo"``/``"nccl"``; defaults by device.
        timeout: timeout of the world's collectives.
        tensor_parallel_size: processes that split each layer (the world is a ``data_parallel`` x
            ``tensor_parallel`` mesh, as Lightning's ``ModelParallelStrategy`` names them; they see
            the same batches).
        expert_parallel_size: processes that split a MoE layer's experts, each owning whole ones:
            1, or all the data-parallel processes (with ``tensor_parallel_size=1``).

    With either above 1 the module must parallelize itself: ``module.parallelize(tp_mesh, ep_mesh)``
    (``None`` for a size of 1) applies the plan in place and returns the parameters FSDP2 must leave
    alone (whole experts); the module may instead shard itself in ``configure_model``.
    """

    strategy_name = "fsdp2"

    def __init__(
        self,
        unit_classes: Sequence[str] | None = None,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        tensor_parallel_size: int = 1,
        expert_parallel_size: int = 1,
    ) -> None:
        if tensor_parallel_size < 1 or expert_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} and expert_parallel_size="
                             f"{expert_parallel_size} must be at least 1")
        if tensor_parallel_size > 1 and expert_parallel_size > 1:
            raise ValueError("tensor and expert parallelism in one island are not supported together: set "
                             "tensor_parallel_size=1 or expert_parallel_size=1")
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.unit_classes = list(unit_classes) if unit_classes else None
        self.reshard_after_forward = reshard_after_forward
        self.expert_parallel_size = expert_parallel_size

    @property
    def parallel_sizes(self) -> dict[str, int]:
        """The world's mesh: ``{"dp": data parallel, "tp": tensor parallel, "ep": expert parallel}``."""
        tp = int(self._tensor_parallel_size)
        return {"dp": self.num_nodes * self.num_processes // tp, "tp": tp, "ep": self.expert_parallel_size}

    @override
    def setup_environment(self) -> None:
        # The data-parallel dimension spans what tensor parallelism leaves of the whole world
        # (Lightning's "auto" would use the nodes).
        world, tp = self.num_nodes * self.num_processes, int(self._tensor_parallel_size)
        if world % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the {world} processes of this world: "
                             "give it a divisor of the island's devices x nodes")
        if self.expert_parallel_size not in (1, world // tp):
            raise ValueError(f"expert_parallel_size={self.expert_parallel_size} must be 1 or the {world // tp} "
                             "data-parallel processes (experts are spread over all of them)")
        if self._data_parallel_size == "auto":
            self._data_parallel_size = world // tp
        init_restarted_world(self._get_process_group_backend(), self._timeout or default_pg_timeout)
        super().setup_environment()
        if dist.is_initialized() and dist.get_backend() != "nccl":
            destroy_world_at_exit()

    def shard_module(self, module: pl.LightningModule) -> None:
        """Apply the module's own parallel plan (tensor or expert parallel, if asked for), then the
        wrapping policy, unless the module shards itself or is already sharded."""
        if is_fully_sharded(module):
            return
        mesh, sizes = self.device_mesh, self.parallel_sizes
        ignored: set = set()
        if sizes["tp"] > 1 or sizes["ep"] > 1:
            plan = getattr(module, "parallelize", None)
            if not callable(plan):
                raise TypeError(
                    f"tensor_parallel_size={sizes['tp']}, expert_parallel_size={sizes['ep']} need "
                    f"{type(module).__name__} to parallelize itself: implement parallelize(tp_mesh, ep_mesh) "
                    "(returning the parameters FSDP2 must leave alone), or shard it in configure_model")
            ignored = set(plan(mesh["tensor_parallel"] if sizes["tp"] > 1 else None,
                               mesh["data_parallel"] if sizes["ep"] > 1 else None) or ())
        apply_fully_shard(module, mesh["data_parallel"], unit_classes=self.unit_classes,
                          reshard_after_forward=self.reshard_after_forward, ignored_params=ignored)

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
        if self.parallel_sizes["tp"] > 1:  # gradients on two meshes: torch's clip cannot stack their norms
            plugin = self.precision_plugin
            plugin.clip_grad_by_norm = lambda optimizer, clip_val: clip_grad_norm_across_meshes(  # type: ignore
                plugin.main_params(optimizer), clip_val)
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


register()  # importing this module makes the name resolve (lightning_islands/__init__.py)
