"""Shared fixtures: run islands as real torch.distributed.run processes on this machine."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest
import torch

from lightning_islands.app.launch import report_failures, run_islands

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(autouse=True, scope="session")
def _quiet_env():
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    yield


def launch(islands, args, log_dir, expect_ok=True):
    """Run tests/scripts/<args[0]> as islands; returns (results, combined output)."""
    buf = io.StringIO()
    results = run_islands(islands, [sys.executable, str(SCRIPTS / args[0]), *map(str, args[1:])],
                          log_dir=log_dir, live=False, out=buf, env={"OMP_NUM_THREADS": "1"})
    text = buf.getvalue()
    if expect_ok and any(r.returncode != 0 for r in results):
        err = io.StringIO()
        report_failures(results, err)
        raise AssertionError(f"islands failed:\n{err.getvalue()}\n--- output ---\n{text[-6000:]}")
    return results, text


def load_rounds(out: Path, island: int) -> dict[int, dict]:
    """``{round: saved}`` for one island of an islands_regression run."""
    rounds = {}
    for p in sorted(out.glob(f"island{island}_round*.pt")):
        saved = torch.load(p, weights_only=False)
        rounds[saved["round"]] = saved
    return rounds
