"""Shared fixtures: run islands as real torch.distributed.run processes on this machine."""

from __future__ import annotations

import io
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_islands.launch import report_failures, run_islands

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(autouse=True, scope="session")
def _quiet_env():
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    yield


# KNOWN BUG (open, see the issue notes): now and then a rank of a 2-process island aborts with
# SIGABRT ("terminate called without an active exception") in native code. Until it is found, a
# run that failed with exactly that signature is run once more; any other failure fails the test.
ABORT_SIGNATURE = "(SIGABRT)"


def launch(islands, args, log_dir, expect_ok=True):
    """Run tests/scripts/<args[0]> as islands; returns (results, combined output)."""
    for attempt in range(2):
        buf = io.StringIO()
        results = run_islands(islands, [sys.executable, str(SCRIPTS / args[0]), *map(str, args[1:])],
                              log_dir=log_dir, live=False, out=buf, env={"OMP_NUM_THREADS": "1"})
        text = buf.getvalue()
        failed = any(r.returncode != 0 for r in results)
        if not (failed and ABORT_SIGNATURE in text and attempt == 0):
            break
        warnings.warn(f"islands aborted with SIGABRT (known bug); running {args[0]} once more", stacklevel=2)
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
