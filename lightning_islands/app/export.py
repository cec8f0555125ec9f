"""``lightning-islands export RUN_DIR --out FILE``: the trained model as one file.

A run of ``lightning-islands train`` keeps its model in checkpoints: per island ``final.ckpt``
(written after training), ``last.ckpt`` and ``round{r:06d}.ckpt``. Those of FSDP2 and the islands
are torch distributed checkpoints (a folder of shards), those of ``single``/``ddp`` one file; either
holds the optimizer, the loops' state and, for the islands, the outer state too. :func:`export`
reads only the model from one of them, on CPU and without a process group, and writes it as one
``.safetensors`` file (or ``.pt``: a plain ``torch.save`` of the state dict) whose keys are exactly
``module.state_dict()``'s for the module that ``job.yaml``'s ``model`` node builds. That node goes
beside it (``FILE`` with the suffix ``.yaml``) so that the module can be built again.

An island's checkpoint holds its local parameters under ``state_dict`` and the global ones (the
anchors of the outer steps) in ``islands_outer/``; the export takes the global ones, as Lightning
does when it validates or tests from such a checkpoint. After training (``final.ckpt``) both are the
same; in ``last.ckpt`` or a round's checkpoint, steps after the last outer step are not in the export.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from lightning_islands.engine.checkpoint import OUTER_DIR
from lightning_islands.engine.safe_metadata import METADATA, check_metadata
from lightning_islands.engine.saves import holder, is_round_folder, round_checkpoints

SUFFIXES = (".safetensors", ".pt")
STATE, ANCHOR = "state_dict", "anchor"
# the names wrappers put among a module's own (torch.compile, Lightning's, activation checkpointing)
_WRAPPERS = frozenset({"_orig_mod", "_forward_module", "_checkpoint_wrapped_module"})
_PROG = "lightning-islands export"


class ExportError(ValueError):
    """Input that cannot be exported; the message names the cause and the fix."""


@dataclass
class Exported:
    """What :func:`export` wrote: the file, the model's config beside it, where the weights came
    from, how many parameters (tied ones once) and the file's size in bytes."""

    out: Path
    config: Path
    checkpoint: Path
    global_parameters: bool
    parameters: int
    bytes: int

    def line(self) -> str:
        """The one line the command prints."""
        what = "the global parameters" if self.global_parameters else "the module's parameters"
        return (f"wrote {self.out} ({self.parameters:,} parameters, {self.bytes:,} bytes; model config "
                f"{self.config}) from {what} of {self.checkpoint}")


# ---------------------------------------------------------------------- the run and its checkpoint
def check_out(out: Path) -> None:
    """Refuse an ``--out`` that is not a ``.safetensors``/``.pt`` file in an existing folder."""
    if out.suffix not in SUFFIXES:
        raise ExportError(f"--out {out}: {out.suffix or 'no suffix'} is not a format the export writes; end the name "
                          "with .safetensors (safetensors) or .pt (a torch state dict)")
    if out.is_dir():
        raise ExportError(f"--out {out} is a folder; give a file name, e.g. {out / ('model' + out.suffix)}")
    if not out.parent.is_dir():
        raise ExportError(f"--out {out}: the folder {out.parent} does not exist; create it first (mkdir -p "
                          f"{out.parent}) or write elsewhere")


def read_job(run_dir: Path) -> DictConfig:
    """``RUN_DIR/job.yaml``, the resolved job of a run; refused if there is none or it has no model."""
    job = run_dir / "job.yaml"
    if not job.is_file():
        runs = sorted(p.parent for p in run_dir.glob("*/job.yaml"))[:3] if run_dir.is_dir() else []
        hint = (f" (its subfolders {', '.join(str(p) for p in runs)} are runs)" if runs else
                " (the folder `lightning-islands train` printed as its run folder)")
        raise ExportError(f"{run_dir} has no job.yaml, so it is not the folder of one run; give a run's folder{hint}")
    try:
        cfg = OmegaConf.load(job)
    except Exception as err:  # noqa: BLE001 - a damaged job.yaml
        raise ExportError(f"could not read {job} ({type(err).__name__}: {str(err)[:300]}); give the folder of a "
                          "`lightning-islands train` run") from err
    if not isinstance(cfg, DictConfig) or "_target_" not in cfg.get("model", {}):
        raise ExportError(f"{job} has no model node with a _target_; give the folder of a `lightning-islands train` "
                          "run")
    return cfg


def island_count(cfg: DictConfig) -> int:
    """How many islands the job ran: ``islands.members`` for the islands strategy, else one world."""
    if cfg.get("strategy", {}).get("name") == "islands":
        return len(cfg.islands.members)
    return 1


def check_island(cfg: DictConfig, island: int, run_dir: Path) -> None:
    """Refuse an island index the run does not have."""
    count = island_count(cfg)
    if count == 1 and island != 0:
        raise ExportError(f"--island {island}: the run {run_dir} has one island (one world); give --island 0 or "
                          "leave it out")
    if not 0 <= island < count:
        raise ExportError(f"--island {island}: the run {run_dir} has {count} islands; give --island from 0 to "
                          f"{count - 1}")


def _existing(path: Path, named: str) -> Path:
    found = holder(path)  # also where a save cut short left it
    if found is None:
        raise ExportError(f"--checkpoint {named}: there is no checkpoint at {path}; give final, last or the path of "
                          "a checkpoint")
    if is_round_folder(found):
        latest = max(round_checkpoints(found, repair=False).items())[1]
        raise ExportError(f"--checkpoint {named}: {found} is a folder of round checkpoints; give one of them, e.g. "
                          f"--checkpoint {latest}")
    return found


def choose_checkpoint(run_dir: Path, island: int, which: str | None = None) -> Path:
    """Where the checkpoint to export lies: ``which`` is ``final``, ``last``, a path (absolute, from
    here, or in the island's checkpoint folder) or ``None`` (``final.ckpt`` if there is one, else
    ``last.ckpt``); a checkpoint whose save was interrupted is found where it lies."""
    folder = run_dir / f"island{island}" / "checkpoints"
    if which in ("final", "last"):
        return _existing(folder / f"{which}.ckpt", which)
    if which is not None:
        path = Path(which)
        return _existing(path if path.is_absolute() or holder(path) is not None else folder / path, which)
    for name in ("final.ckpt", "last.ckpt"):
        found = holder(folder / name)
        if found is not None:
            return found
    rounds = round_checkpoints(folder, repair=False)
    hint = (f"; give --checkpoint {rounds[max(rounds)].name} (its latest round checkpoint)" if rounds else
            "; the run ended before it wrote one (trainer.checkpoint_every_n_steps, and final.ckpt after training)")
    raise ExportError(f"island {island} of {run_dir} has no final.ckpt or last.ckpt in {folder}{hint}")


# ---------------------------------------------------------------------- the module it belongs to
def build_module(model: DictConfig) -> nn.Module:
    """The module of ``model`` (a node with a ``_target_``), built on the meta device (no memory)
    where it allows, else on CPU: its state dict's names, shapes and tied parameters."""
    from hydra.utils import instantiate

    try:
        with torch.device("meta"):
            return instantiate(model)
    except Exception:  # noqa: BLE001 - a constructor that needs real tensors: build it on CPU
        pass
    try:
        return instantiate(model)
    except Exception as err:  # noqa: BLE001 - any failure of the user's constructor, named below
        raise ExportError(f"could not build the model {model._target_} of job.yaml ({type(err).__name__}: "
                          f"{str(err)[:300]}); install what it needs where you export") from err


def canonical_names(module: nn.Module) -> dict[str, str]:
    """Each parameter's state-dict name to the name it has in ``named_parameters()`` (the first of
    tied ones): the name the islands keep its global value under."""
    first: dict[int, str] = {}
    names = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names[name] = first.setdefault(id(p), name)
    return names


def plain_name(name: str) -> str:
    """A checkpoint's name for a module entry without the names that wrappers put in it."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


# ---------------------------------------------------------------------- reading checkpoints
def _unreadable(path: Path, err: BaseException) -> ExportError:
    return ExportError(f"could not read the checkpoint {path} ({type(err).__name__}: {str(err)[:300]}); it is "
                       "incomplete or damaged: export another one (--checkpoint last, or a round checkpoint)")


def dcp_entries(folder: Path, prefix: str) -> dict[str, tuple[str, torch.Size, torch.dtype]]:
    """The tensors under ``prefix`` in a distributed checkpoint: plain name to (stored name, shape,
    dtype), from its ``.metadata`` (checked first: torch unpickles it unrestricted)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        check_metadata(folder)
        stored = FileSystemReader(folder).read_metadata().state_dict_metadata
    except ValueError as err:  # check_metadata's refusal names the file and the fix
        raise ExportError(str(err)) from err
    except Exception as err:  # noqa: BLE001 - a damaged .metadata
        raise _unreadable(folder, err) from err
    return {plain_name(k[len(prefix) + 1 :]): (k[len(prefix) + 1 :], m.size, m.properties.dtype)
            for k, m in stored.items() if k.startswith(f"{prefix}.") and isinstance(m, TensorStorageMetadata)}


def read_dcp(folder: Path, prefix: str, entries: dict[str, tuple[str, torch.Size, torch.dtype]]) -> dict[str, Tensor]:
    """The full tensors ``entries`` (of :func:`dcp_entries`) under ``prefix``, read on CPU without a
    process group; every rank's shards come together into one plain tensor."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    tensors = {stored: torch.empty(shape, dtype=dtype) for stored, shape, dtype in entries.values()}
    if tensors:
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
                dcp_load({prefix: tensors}, storage_reader=FileSystemReader(folder), no_dist=True)
        except (Exception, CheckpointException) as err:
            raise _unreadable(folder, err) from err
    return {plain: tensors[stored] for plain, (stored, _, _) in entries.items()}


def read_file(path: Path) -> dict[str, Tensor]:
    """The module's state dict of a one-file Lightning checkpoint (``single``, ``ddp``): tensors
    and plain data only, a load that could run code is refused."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise ExportError(f"{path} holds more than tensors and plain data, and loading it could run code; export a "
                          f"checkpoint that Lightning wrote ({str(err).splitlines()[0][:200]})") from err
    except Exception as err:  # noqa: BLE001 - not a checkpoint, or damaged
        raise _unreadable(path, err) from err
    state = checkpoint.get(STATE) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ExportError(f"{path} is not a Lightning checkpoint (it has no state_dict); export a checkpoint of a run")
    return {plain_name(k): v for k, v in state.items() if isinstance(v, Tensor)}


# ---------------------------------------------------------------------- the global state dict
def _check_names(path: Path, have: dict[str, Any], module: nn.Module, target: str) -> None:
    """Refuse a checkpoint whose module entries are not those (names, shapes) of ``module``."""
    expected = module.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in have]
    extra = [k for k in have if k not in expected]
    shapes = [k for k in expected if k in have and tuple(_shape(have[k])) != tuple(expected[k].shape)]
    if missing or extra or shapes:
        what = "; ".join(f"{label} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}" for label, names in
                         (("missing", missing), ("not in the model", extra), ("shaped otherwise", shapes)) if names)
        raise ExportError(f"{path} does not hold the model {target} of job.yaml ({what}); export a checkpoint of "
                          "this run, with its job.yaml")


def _shape(entry: Any) -> torch.Size:
    return entry.shape if isinstance(entry, Tensor) else entry[1]


def _distinct(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with no two entries sharing memory (tied weights: safetensors refuses shared tensors)."""
    seen: set[int] = set()
    out = {}
    for k, t in state.items():
        t = t.contiguous()
        out[k] = t.clone() if t.untyped_storage().data_ptr() in seen else t
        seen.add(out[k].untyped_storage().data_ptr())
    return out


def dcp_state_dict(path: Path, module: nn.Module, target: str) -> tuple[dict[str, Tensor], bool]:
    """The module's state dict from a distributed checkpoint folder and whether its parameters are
    the islands' global ones (``islands_outer/`` anchors, cast to the module's stored dtype)."""
    if not (path / METADATA).is_file():
        raise ExportError(f"{path} is a folder without {METADATA}, so not a torch distributed checkpoint; export a "
                          "checkpoint that `lightning-islands train` wrote")
    entries = dcp_entries(path, STATE)
    _check_names(path, entries, module, target)
    canon = canonical_names(module)
    outer = path / OUTER_DIR
    anchors: dict[str, Tensor] = {}
    if (outer / METADATA).is_file():
        wanted = set(canon.values())
        anchors = read_dcp(outer, ANCHOR, {k: v for k, v in dcp_entries(outer, ANCHOR).items() if k in wanted})
    local = read_dcp(path, STATE, {k: v for k, v in entries.items() if canon.get(k) not in anchors})
    state = {k: local[k] if k in local else anchors[canon[k]].to(entries[k][2]) for k in module.state_dict()}
    return state, bool(anchors)


def global_state_dict(path: Path, module: nn.Module, target: str) -> tuple[dict[str, Tensor], bool]:
    """The state dict of ``module`` (names exactly ``module.state_dict()``'s, plain full tensors on
    CPU) held by the checkpoint ``path`` (a folder or one file), and whether its parameters are the
    islands' global ones."""
    if path.is_dir():
        state, is_global = dcp_state_dict(path, module, target)
    else:
        state, is_global = read_file(path), False
        _check_names(path, state, module, target)
        state = {k: state[k] for k in module.state_dict()}
    return _distinct({k: t.detach().to("cpu") for k, t in state.items()}), is_global


# ---------------------------------------------------------------------- writing
def write_state(state: dict[str, Tensor], out: Path, metadata: dict[str, str]) -> None:
    """Write ``state`` to ``out`` (safetensors or ``torch.save``), beside it first, then moved into place."""
    partial = out.with_name(out.name + ".partial")
    try:
        if out.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(state, str(partial), metadata=metadata)
        else:
            torch.save(state, partial)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(partial, 0o666 & ~mask)  # as any file written here (safetensors writes it for its owner alone)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)


def export(run_dir: Path | str, out: Path | str, island: int = 0, checkpoint: str | None = None) -> Exported:
    """Write the model of a run's checkpoint (island ``island``; ``checkpoint``: see
    :func:`choose_checkpoint`) to ``out`` and its config to ``out`` with the suffix ``.yaml``.
    Bad input is an :class:`ExportError` naming the cause and the fix."""
    run_dir, out = Path(run_dir), Path(out)
    check_out(out)
    cfg = read_job(run_dir)
    check_island(cfg, island, run_dir)
    config = out.with_suffix(".yaml")
    if config.resolve() == (run_dir / "job.yaml").resolve():
        raise ExportError(f"--out {out} would put the model's config over the run's {config}; write elsewhere")
    path = choose_checkpoint(run_dir, island, checkpoint)
    target = str(cfg.model._target_)
    module = build_module(cfg.model)
    state, is_global = global_state_dict(path, module, target)
    write_state(state, out, {"format": "pt", "model": target, "checkpoint": str(path)})
    OmegaConf.save(cfg.model, config)
    parameters = sum(p.numel() for p in module.parameters())
    return Exported(out, config, path, is_global, parameters, out.stat().st_size)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_PROG, description="Write the trained model of a run as one file.")
    parser.add_argument("run_dir", help="the folder of one run of `lightning-islands train` (it holds job.yaml)")
    parser.add_argument("--out", required=True, help="the file to write: NAME.safetensors or NAME.pt (a torch state "
                                                     "dict); the model's config goes to NAME.yaml beside it")
    parser.add_argument("--island", type=int, default=0, help="whose checkpoint (default 0; islands end equal)")
    parser.add_argument("--checkpoint", default=None, metavar="final|last|PATH",
                        help="which checkpoint (default: final.ckpt if there is one, else last.ckpt); PATH: a "
                             "checkpoint, e.g. round000004.ckpt in the island's checkpoint folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``lightning-islands export RUN_DIR --out FILE [--island I] [--checkpoint final|last|PATH]``;
    bad input: a message on stderr and exit code 2."""
    args = _parser().parse_args(argv)
    try:
        done = export(args.run_dir, args.out, island=args.island, checkpoint=args.checkpoint)
    except ExportError as err:
        print(f"{_PROG}: {err}", file=sys.stderr)
        return 2
    print(f"{_PROG}: {done.line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
