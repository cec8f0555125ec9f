"""Read a distributed checkpoint's ``.metadata`` without running code from it.

torch's ``FileSystemReader`` unpickles ``.metadata`` with no restriction, so a crafted checkpoint
runs whatever it names. :func:`check_metadata` unpickles it first with only the classes a torch
distributed checkpoint's metadata holds (its dataclasses and enums, ``torch.Size``, dtypes,
layouts, paths); anything else is refused, naming the file and the global, before torch reads it.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

METADATA = ".metadata"
_ANY_NAME = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
            ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("builtins", "set"),
            ("builtins", "frozenset"), ("builtins", "slice"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
            ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}
_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:  # a dotted name walks attributes (``metadata.os.system``): never
            if (module, name) in _ALLOWED:
                return super().find_class(module, name)
            if module in _ANY_NAME:  # only the classes defined there, not what the module imports
                found = super().find_class(module, name)
                if isinstance(found, type) and found.__module__ == module:
                    return found
            if module == "torch" and isinstance(getattr(torch, name, None), _VALUES):
                return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def check_metadata(folder: Path) -> None:
    """Refuse ``folder/.metadata`` (if there is one) when it names anything but what a torch
    distributed checkpoint's metadata holds: a ``ValueError`` naming the file, the global and the fix."""
    path = folder / METADATA
    if not path.is_file():
        return
    try:
        with path.open("rb") as f:
            _Restricted(f).load()
    except pickle.UnpicklingError as err:
        raise ValueError(f"{path} holds more than a checkpoint's metadata ({err}), and reading it could run code; "
                         "resume from a checkpoint that Lightning and lightning_islands wrote") from err
