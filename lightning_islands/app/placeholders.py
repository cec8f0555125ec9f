"""``${li:KEY}`` in the job: values only an island's process knows, filled in where it runs.

The driver resolves the composed job once, for every island, before any island exists; a logger's
folder or name must still differ per island. ``${li:island}`` (this island's index), ``${li:run_dir}``
(the run folder) and ``${li:launch}`` (one name per launch: the run folder's) stay as written
until :func:`fill` tells this process which island it is; then they resolve like any other
interpolation. Importing this module registers the resolver.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

KEYS = ("island", "run_dir", "launch")
_values: dict[str, Any] = {}


def _resolve(key: str) -> Any:
    if key not in KEYS:
        raise ValueError(f"${{li:{key}}} is not a placeholder of the job; use one of "
                         f"{', '.join('${li:' + k + '}' for k in KEYS)}")
    return _values.get(key, "${li:" + key + "}")  # unknown here: left for the island's process


def fill(**values: Any) -> None:
    """This process's values (``island``, ``run_dir``, ``launch``); later resolutions use them."""
    unknown = set(values) - set(KEYS)
    if unknown:
        raise ValueError(f"unknown placeholder(s) {sorted(unknown)}; the placeholders are {KEYS}")
    _values.update(values)


def clear() -> None:
    """Forget this process's values (tests, or a driver that launches again)."""
    _values.clear()


def register() -> None:
    """Register the ``li`` resolver with OmegaConf (idempotent)."""
    if not OmegaConf.has_resolver("li"):
        OmegaConf.register_new_resolver("li", _resolve, use_cache=False)


register()
