"""The wheel ships every file the checkout runs from: each folder is a listed package, each file a
listed pattern.

Hydra composes from `lightning_islands.conf` and `lightning_islands.recipes`, so a folder or file left
out of pyproject.toml works from a checkout (editable install) and breaks only for a user who
installed a wheel.
"""

from __future__ import annotations

import fnmatch
import importlib
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10; the test extra installs tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _setuptools_table() -> dict:
    return _pyproject()["tool"]["setuptools"]


def _source_files(folders: list[str]) -> list[Path]:
    """Files under the mapped folders, relative to the root, less bytecode caches."""
    return [path.relative_to(ROOT) for folder in folders for path in (ROOT / folder).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts]


def _package_of(folder: Path, package_dir: dict[str, str]) -> str | None:
    """The package a repository folder installs as, from the `package-dir` mapping (longest match)."""
    best = None
    for name, src in package_dir.items():
        src_path = Path(src)
        if folder == src_path or src_path in folder.parents:
            if best is None or len(src_path.parts) > len(Path(package_dir[best]).parts):
                best = name
    if best is None:
        return None
    rest = folder.relative_to(package_dir[best]).parts
    return ".".join((best, *rest))


def _shipped_files() -> dict[str, list[str]]:
    """Files under the mapped source folders, by the package that installs them."""
    package_dir = _setuptools_table()["package-dir"]
    by_package: dict[str, list[str]] = {}
    for path in _source_files(sorted(set(package_dir.values()))):
        package = _package_of(path.parent, package_dir)
        if package is not None:
            by_package.setdefault(package, []).append(path.name)
    return by_package


def test_every_folder_with_files_is_a_listed_package():
    listed = set(_setuptools_table()["packages"])
    shipped = _shipped_files()
    assert "lightning_islands.recipes.experiment" in shipped  # the mapping is read as setuptools does
    missing = sorted(set(shipped) - listed)
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {missing}"
    stale = sorted(listed - set(shipped))
    assert not stale, f"listed in pyproject.toml but no folder holds them: {stale}"


def test_every_file_matches_a_package_data_pattern():
    package_data = _setuptools_table()["package-data"]
    unmatched = []
    for package, names in _shipped_files().items():
        patterns = package_data.get("*", []) + package_data.get(package, [])
        for name in names:
            if not name.endswith(".py") and not any(fnmatch.fnmatch(name, p) for p in patterns):
                unmatched.append(f"{package}: {name}")
    assert not unmatched, f"add a [tool.setuptools.package-data] pattern for: {unmatched}"


def test_console_script_names_a_function_that_exists():
    """A stale entry point (a module moved, a function renamed) installs fine and fails only when run."""
    scripts = _pyproject()["project"]["scripts"]
    assert set(scripts) == {"lightning-islands"}
    module, _, function = scripts["lightning-islands"].partition(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_the_command_starts_without_lightning_and_the_strategy_classes_register_their_names():
    """``import lightning_islands`` (and so every ``lightning-islands`` command, the launcher and the
    engine) loads no Lightning; the first use of ``IslandStrategy`` registers ``"islands"``."""
    import subprocess

    code = ("import sys, lightning_islands.app.launch, lightning_islands.engine.round\n"
            "assert 'lightning' not in sys.modules, sorted(m for m in sys.modules if m.startswith('lightning.'))\n"
            "from lightning_islands import FSDP2Strategy, IslandStrategy\n"
            "from lightning.pytorch.strategies import StrategyRegistry\n"
            "assert StrategyRegistry['islands']['strategy'] is IslandStrategy\n"
            "assert StrategyRegistry['fsdp2']['strategy'] is FSDP2Strategy\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    import lightning_islands

    assert set(lightning_islands.__all__) <= set(dir(lightning_islands))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        lightning_islands.Nope  # noqa: B018
