"""The delay an emulated slow island sleeps after each step: a constant, or a schedule that changes
during the run (as a shared cluster's speed does).

``0.5`` sleeps 0.5 s after every step; ``"1.5,0.5@200,1.5@400"`` sleeps 1.5 s after steps 0-199,
0.5 s after steps 200-399 and 1.5 s from step 400 on (steps counted from 0, as ``global_step``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

FORM = "a number of seconds, or a schedule 'SECONDS[,SECONDS@STEP...]' such as '1.5,0.5@200,1.5@400'"


@dataclass(frozen=True)
class StepDelays:
    """Seconds to sleep after each step: ``seconds[k]`` from step ``starts[k]`` on (``starts[0] == 0``)."""

    starts: tuple[int, ...]
    seconds: tuple[float, ...]

    def at(self, step: int) -> float:
        """The delay after step ``step`` (counted from 0)."""
        return self.seconds[bisect.bisect_right(self.starts, step) - 1]

    @property
    def active(self) -> bool:
        """Whether any step sleeps at all."""
        return any(s > 0 for s in self.seconds)


def parse_step_delays(value: object, where: str = "step_delay_s") -> StepDelays:
    """``0.5`` or ``"1.5,0.5@200,1.5@400"`` -> :class:`StepDelays`; a ValueError names ``where`` and
    the accepted form."""
    if isinstance(value, bool):
        raise ValueError(f"{where} must be {FORM}, got {value!r}")
    if isinstance(value, (int, float)):
        parts: list[str] = [repr(float(value))]
    elif isinstance(value, str) and value.strip():
        parts = [p.strip() for p in value.split(",")]
    else:
        raise ValueError(f"{where} must be {FORM}, got {value!r}")
    starts, seconds = [], []
    for k, part in enumerate(parts):
        delay, at, step = part.partition("@")
        try:
            s = float(delay)
            start = int(step) if at else 0
        except ValueError:
            raise ValueError(f"{where}: cannot read {part!r}; give {FORM}") from None
        if not s >= 0 or s == float("inf"):
            raise ValueError(f"{where}: {part!r} is not a finite delay >= 0; give {FORM}")
        if (k == 0) == bool(at):
            raise ValueError(f"{where}: {part!r}: only the first delay has no '@STEP' (it holds from step 0); "
                             f"give {FORM}")
        if starts and start <= starts[-1]:
            raise ValueError(f"{where}: step {start} of {part!r} does not come after step {starts[-1]}; give {FORM}")
        starts.append(start)
        seconds.append(s)
    return StepDelays(tuple(starts), tuple(seconds))
