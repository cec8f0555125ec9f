"""The Hydra app: ``lightning-islands train`` / ``python -m lightning_islands.app.train``.

A driver, not a trainer: it composes the config, writes the resolved job to the run folder,
launches the islands (or the one world of ``single``/``ddp``/``fsdp``) with torch.distributed.run,
waits, and prints a summary. Because this process never becomes a training process, Hydra's
multirun (``-m``) sweeps work: each job is one launch.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

from lightning_islands.startup import startup_imports

# Hydra, torch and Lightning: a fifth less CPU at start (see lightning_islands.startup)
with startup_imports(main=__name__ == "__main__"):
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.experimental.callback import Callback
    from omegaconf import DictConfig, ListConfig, OmegaConf

    from lightning_islands.app import placeholders
    from lightning_islands.app.components import centralized_batch, check_job
    from lightning_islands.app.gpus import place_islands
    from lightning_islands.app.launch import report_failures, run_islands
    from lightning_islands.app.netns import LinkUnavailable, check_link_support, parse_link
    from lightning_islands.app.report import build_report
    from lightning_islands.app.settings import check_islands
    from lightning_islands.app.summary import format_summary, summarize


def config_dir() -> str:
    """The ``conf/`` folder: beside the package in a checkout, else the installed package data."""
    checkout = Path(__file__).resolve().parents[2] / "conf"
    if (checkout / "config.yaml").exists():
        return str(checkout)
    return "pkg://lightning_islands.conf"


def unwritable_folder(folder: Path) -> str | None:
    """Why ``folder`` cannot be created and written, or ``None`` when it can."""
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user"
    return None


class Preflight(Callback):
    """Hydra callback (``hydra.callbacks.preflight``): refuse a run or sweep folder that cannot be
    written before Hydra creates it, with the folder and the fix instead of a traceback."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(Path(config.hydra.run.dir), "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(Path(config.hydra.sweep.dir), "hydra.sweep.dir")

    @staticmethod
    def _check(folder: Path, key: str) -> None:
        why = unwritable_folder(folder.resolve())
        if why:
            raise SystemExit(f"lightning-islands: cannot write the run folder {folder}: {why}; write runs elsewhere "
                             f"with {key}=PATH (or run from a folder you can write)")


def island_plan(cfg: DictConfig) -> list[int]:
    """Processes per island: ``islands.members[*].devices`` for islands, else one world."""
    if cfg.strategy.name == "islands":
        return [int(m.devices) for m in cfg.islands.members]
    return [int(cfg.strategy.get("devices", 1))]


def island_accelerators(cfg: DictConfig) -> list[str]:
    """What each island runs on, for the launcher's GPU plan (:mod:`~lightning_islands.app.gpus`):
    ``islands.members[i].accelerator``, else ``trainer.accelerator`` (``cuda`` is ``gpu``; anything
    but ``gpu`` and ``cpu`` is ``auto``)."""
    default = str(cfg.trainer.get("accelerator") or "auto").lower()
    members = cfg.islands.members if cfg.strategy.name == "islands" else [{}]
    chosen = [str(m.get("accelerator") or default).lower() for m in members]
    return [{"cuda": "gpu"}.get(a, a) if a in ("cuda", "gpu", "cpu") else "auto" for a in chosen]


def gpu_sharing(cfg: DictConfig) -> str:
    """``islands.gpus`` (``own`` or ``shared``) for the islands strategy; one world owns its GPUs."""
    return str(cfg.islands.get("gpus") or "own") if cfg.strategy.name == "islands" else "own"


def link_spec(cfg: DictConfig) -> str | None:
    """``islands.link`` as ``"RATE[,RTT][,tuned][,I=RATE]"`` (a list ``[1gbit,100ms]`` is joined; Hydra reads an
    unquoted comma as a sweep), or ``None``: none, or not the islands strategy."""
    link = cfg.islands.get("link") if cfg.strategy.name == "islands" else None
    if link is None or link == "":
        return None
    if isinstance(link, (list, ListConfig)):
        return ",".join(str(part) for part in link)
    return str(link)


def drive(cfg: DictConfig) -> dict[str, Any]:
    """Run the composed job to the end; returns the summary (raises SystemExit if an island failed)."""
    # At exit, finalization's last garbage collection skips what importing torch and Lightning made
    # (about a second of CPU less; see lightning_islands.fsdp.destroy_world_at_exit)
    atexit.unregister(gc.freeze)  # once, however many jobs a multirun drives
    atexit.register(gc.freeze)
    try:  # every setting checked before anything starts
        if cfg.strategy.name == "islands":
            check_islands(cfg.islands)
        check_job(cfg)
        batch = centralized_batch(cfg) if cfg.strategy.get("match_islands") else None
    except (TypeError, ValueError) as err:
        raise SystemExit(f"lightning-islands: {err}") from err
    link = link_spec(cfg)
    if link is not None:  # before anything starts: a bad spec or a machine without root/iproute2
        try:
            parse_link(link)
            check_link_support()
        except (ValueError, LinkUnavailable) as err:
            raise SystemExit(f"lightning-islands: islands.link: {err}") from err
    plan, accelerators = island_plan(cfg), island_accelerators(cfg)
    try:  # before anything starts: GPUs the machine does not have
        place_islands(plan, accelerators, gpu_sharing(cfg))
    except ValueError as err:
        raise SystemExit(f"lightning-islands: {err}") from err
    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    placeholders.clear()  # ${li:...} stays for each island's process to fill
    job = OmegaConf.to_container(cfg, resolve=True)
    job["run_dir"] = str(run_dir)  # type: ignore[index]
    if batch is not None:  # the centralized baseline at the islands' windows per step
        job["data"]["batch_size"] = batch  # type: ignore[index]
    job_path = run_dir / "job.yaml"
    OmegaConf.save(OmegaConf.create(job), job_path)
    print(f"lightning-islands: {cfg.strategy.name}, islands {plan}, run folder {run_dir}", flush=True)
    restarts = int(cfg.islands.get("max_restarts", 0) or 0) if cfg.strategy.name == "islands" else 0
    coordinator = cfg.islands.get("coordinator") if cfg.strategy.name == "islands" else None
    results = run_islands(plan, [sys.executable, "-m", "lightning_islands.app.worker", str(job_path)],
                          log_dir=run_dir, link=link, max_restarts=restarts, coordinator=coordinator,
                          accelerators=accelerators, gpus=gpu_sharing(cfg))
    code = report_failures(results)
    if code:
        raise SystemExit(code)
    summary = summarize(run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    try:  # this run's table and plots (lightning-islands report RUN_DIR draws the same for many runs)
        summary["plots"] = [str(p) for p in build_report(run_dir, run_dir / "report").plots]
    except (OSError, ValueError) as err:
        print(f"lightning-islands: no report for this run ({err})", flush=True)
    print(format_summary(summary), flush=True)
    if cfg.get("summary_json", True):
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    else:
        (run_dir / "summary.json").unlink()
    return summary


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def main(cfg: DictConfig) -> float:
    """Hydra entry point; returns the final validation loss (for sweepers that optimise it)."""
    return float(drive(cfg)["val_loss"])


if __name__ == "__main__":
    main()
