"""Which GPUs each island on this machine sees (``CUDA_VISIBLE_DEVICES``), so that islands started
side by side do not all train on the lowest-numbered GPUs.

Each island runs on ``gpu`` or ``cpu`` (``auto``: ``gpu`` where this machine shows GPUs). With
``gpus="own"`` (the default) the GPU islands take disjoint GPUs in island order, as many as they
have processes; an island set that needs more than the machine shows is refused with the numbers
(``auto`` islands then share the GPUs instead, with a warning). ``gpus="shared"`` lets every GPU
island see every GPU (islands emulated on one device). A CPU island sees none. Each island's
process learns its accelerator from ``LI_ACCELERATOR`` (``gpu`` or ``cpu``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

ENV_ACCELERATOR = "LI_ACCELERATOR"
ACCELERATORS = ("auto", "gpu", "cpu")
SHARING = ("own", "shared")


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out, as ``CUDA_VISIBLE_DEVICES`` entries: the ones it sees
    itself (its own ``CUDA_VISIBLE_DEVICES``, in order, else ``0..count-1``)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    inherited = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return inherited[:count]
    return [str(i) for i in range(count)]


def parse_accelerators(text: str | Sequence[str] | None, num_islands: int) -> list[str]:
    """``"gpu,cpu"`` (one per island) or ``"gpu"`` (every island) -> one accelerator per island;
    ``None``: ``auto`` for every island. A ValueError names the accepted values."""
    parts = ["auto"] if text is None else [p.strip().lower() for p in
                                           (text.split(",") if isinstance(text, str) else text)]
    if len(parts) == 1:
        parts *= num_islands
    if len(parts) != num_islands:
        raise ValueError(f"accelerators {','.join(parts)!r} name {len(parts)} islands, the run has {num_islands}; "
                         f"give one for all or one per island, e.g. gpu,cpu")
    bad = [p for p in parts if p not in ACCELERATORS]
    if bad:
        raise ValueError(f"accelerator {bad[0]!r} is not one of {', '.join(ACCELERATORS)}")
    return parts


@dataclass(frozen=True)
class GpuPlan:
    """The environment that says what each island runs on and sees (``env[i]``); ``warning``: why
    ``auto`` islands share GPUs, when they do."""

    env: tuple[dict[str, str], ...]
    warning: str | None = None


def place_islands(islands: Sequence[int], accelerators: str | Sequence[str] | None, sharing: str = "own") -> GpuPlan:
    """:func:`plan_gpus` on this machine's GPUs for ``accelerators`` as :func:`parse_accelerators`
    reads them (a ValueError names what is wrong)."""
    return plan_gpus(islands, parse_accelerators(accelerators, len(islands)), visible_gpus(), sharing)


def plan_gpus(islands: Sequence[int], accelerators: Sequence[str], gpus: Sequence[str],
              sharing: str = "own") -> GpuPlan:
    """Give island ``i`` (``islands[i]`` processes, on ``accelerators[i]``) its GPUs out of ``gpus``
    (:func:`visible_gpus`). A ValueError names what is missing and the ways out."""
    if sharing not in SHARING:
        raise ValueError(f"gpus={sharing!r} is not one of {', '.join(SHARING)}")
    wanted = [("gpu" if gpus else "cpu") if a == "auto" else a for a in accelerators]
    needed = [n for n, a in zip(islands, wanted) if a == "gpu"]
    if any(a == "gpu" for a in wanted) and not gpus:
        island = wanted.index("gpu")
        raise ValueError(f"island {island} should run on GPUs, but this machine shows none (torch.cuda sees no "
                         f"device{_visible()}); run it on the CPU (accelerator cpu) or on a machine with GPUs")
    warning = None
    if sharing == "own" and sum(needed) > len(gpus):
        gpu_islands = [i for i, a in enumerate(wanted) if a == "gpu"]
        what = (f"islands {', '.join(map(str, gpu_islands))} need {sum(needed)} GPUs "
                f"({' + '.join(map(str, needed))} processes) but this machine shows {len(gpus)}{_visible()}")
        if all(accelerators[i] == "gpu" for i in gpu_islands):
            raise ValueError(f"{what}; run fewer processes, put an island on the CPU (accelerators gpu,cpu; "
                             f"islands.members[i].accelerator=cpu) or let the islands share the GPUs (--gpus shared; "
                             f"islands.gpus=shared)")
        warning = f"{what}: the GPU islands share them (--gpus shared); give islands their own with fewer processes"
        sharing = "shared"
    env, start = [], 0
    for nproc, accelerator in zip(islands, wanted):
        if accelerator == "cpu":
            seen = ""
        elif sharing == "shared":
            seen = ",".join(gpus)
        else:
            seen, start = ",".join(gpus[start:start + nproc]), start + nproc
        env.append({"CUDA_VISIBLE_DEVICES": seen, ENV_ACCELERATOR: accelerator})
    return GpuPlan(tuple(env), warning)


def _visible() -> str:
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f", CUDA_VISIBLE_DEVICES={cvd!r}" if cvd is not None else ""
