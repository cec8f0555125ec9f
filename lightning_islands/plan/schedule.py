"""How many inner steps each island takes in each round, as the engine's schedule decides them.

A round is one fragment's sync, every ``H / F`` inner steps. ``balance="none"``: each island runs
``H / F`` (or its fixed ``steps_per_round`` over ``F``), so a fast island waits for the slowest.
``balance="time"``: from the second round on, the budget is ``H / F`` steps of the slowest island and
each island runs ``round(budget / s_i)`` steps, at least 1 and at most ``8 H / F`` (the first round
has no measured step times yet and runs the plain count). ``sync_warmup`` gives the H of the first
rounds.
"""

from __future__ import annotations

from lightning_islands.plan.inputs import PlanInputs


def round_h(inputs: PlanInputs, round_index: int) -> int:
    """Inner steps between syncs in round ``round_index``: its H (``sync_warmup`` first) over ``F``."""
    warmup = inputs.sync_warmup
    h = warmup[round_index] if round_index < len(warmup) else inputs.sync_every
    return max(1, round(h / inputs.fragments))


def planned_steps(inputs: PlanInputs, island: int, round_index: int) -> int:
    """Island ``island``'s steps in round ``round_index`` without time balancing."""
    h = round_h(inputs, round_index)
    fixed = inputs.islands[island].steps_per_round
    return h if fixed is None else max(1, round(fixed * h / inputs.sync_every))


def round_steps(inputs: PlanInputs, rounds: int) -> list[list[int]]:
    """``steps[r][i]``: inner steps island ``i`` takes before the sync point of round ``r``."""
    times = [isl.step_seconds for isl in inputs.islands]
    out = []
    for r in range(rounds):
        if inputs.balance != "time" or r == 0:
            out.append([planned_steps(inputs, i, r) for i in range(inputs.num_islands)])
            continue
        h = round_h(inputs, r)
        budget = h * max(times)
        out.append([max(1, min(8 * h, round(budget / s))) for s in times])
    return out
