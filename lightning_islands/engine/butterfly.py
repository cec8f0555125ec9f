"""Butterfly mixing (Zhao and Canny, SDM 2013): who mixes with whom at each stage, and the mix.

At stage ``k`` an island mixes only with the islands ``2**k`` away, so a slow island delays only
its partners and each island receives one payload per stage instead of ``N - 1``; after
``log2 N`` stages back to back every island holds the token-weighted mean of all of them.

**Units, for island counts that are not a power of two.** With ``M`` the largest power of two at
most ``N``, the islands ``M .. N - 1`` (the extras) each join island ``i - M`` in one *unit*: unit
``u`` is island ``u`` and, if it exists, island ``u + M``. The butterfly runs over the ``M`` units:
at stage ``k`` unit ``u`` mixes with unit ``u XOR 2**k``, so an island mixes with the 1 to 3 other
islands of its two units (a group). ``floor(log2 N)`` stages give the full mix (``N = 3``: one stage
of all three; ``N = 6``: two stages of groups of 3 or 4).

**The mix.** Each island carries a weight: at the start of a cycle of stages its tokens. The first
stage mixes every island of the group (so a unit's islands leave with one state); a later stage
mixes the group's units, each counted once with its carried weight. The mix is
:func:`~lightning_islands.engine.outer.merge`'s weighted average in island order, and every island
of the group leaves with the mixed state and the group's total weight. So
every stage keeps ``sum_i tokens_i * state_i`` (the token-weighted mean) and, in the same arithmetic
on the same inputs, the islands of a group end bit-identical; after the cycle every island holds
the weighted mean of the cycle's start states. A group whose other unit is absent (every island
of it lost) is the identity for the present one.

Pure: no link, no Lightning; the engine decides what a state is (a model, or a model's distance
from the cycle's common anchor) and when a stage runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from lightning_islands.engine.outer import merge


@dataclass(frozen=True)
class Butterfly:
    """The butterfly schedule of ``num_islands`` islands (see the module docstring)."""

    num_islands: int

    def __post_init__(self) -> None:
        if self.num_islands < 1:
            raise ValueError(f"a butterfly needs at least one island, got {self.num_islands}")

    @property
    def units(self) -> int:
        """``M``: the largest power of two at most ``num_islands``."""
        return 1 << (self.num_islands.bit_length() - 1)

    @property
    def stages(self) -> int:
        """Stages of one cycle (a full mix): ``log2 M``, 0 for one island."""
        return self.units.bit_length() - 1

    def unit_of(self, island: int) -> int:
        """The unit island ``island`` belongs to."""
        self._check(island)
        return island if island < self.units else island - self.units

    def islands_of(self, unit: int) -> tuple[int, ...]:
        """The islands of unit ``unit``, in island order."""
        extra = unit + self.units
        return (unit, extra) if extra < self.num_islands else (unit,)

    def stage_of(self, count: int) -> int:
        """The stage of the ``count``-th mix (0-based) of one fragment: stages advance with each
        fragment's own round count, so every fragment meets every partner in turn."""
        return count % self.stages if self.stages else 0

    def group(self, island: int, stage: int) -> tuple[tuple[int, ...], ...]:
        """The units island ``island`` mixes at ``stage``, each as its islands, in unit order (its own
        unit and the partner unit; a single unit for one island)."""
        unit = self.unit_of(island)
        if not self.stages:
            return (self.islands_of(unit),)
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage {stage} is not one of the {self.stages} stages of {self.num_islands} islands")
        partner = unit ^ (1 << stage)
        return tuple(self.islands_of(u) for u in sorted((unit, partner)))

    def peers(self, island: int, stage: int) -> tuple[int, ...]:
        """The other islands whose payloads island ``island`` receives at ``stage``."""
        return tuple(i for unit in self.group(island, stage) for i in unit if i != island)

    def _check(self, island: int) -> None:
        if not 0 <= island < self.num_islands:
            raise ValueError(f"island {island} is not one of 0..{self.num_islands - 1}")


def mix(states: Mapping[int, Tensor], weights: Mapping[int, float], group: Sequence[Sequence[int]],
        first: bool) -> tuple[Tensor, float]:
    """One stage for one group: the mixed state and the group's total weight.

    ``group``: the units (each its islands, as :meth:`Butterfly.group` gives them); ``states`` and
    ``weights``: those of the islands that take part (an absent island is left out; a unit with
    none is left out, and a group with one unit left keeps that unit's state). ``first``: the
    cycle's first stage, where every island counts with its own state and tokens; at a later stage
    a unit's islands hold one state and one weight (from the stages before), so each unit counts
    once, by its first island present. Every island of the group computes the same operations in
    the same order: the same bits.
    """
    if first:
        present = [i for unit in group for i in unit if i in states]
    else:
        present = [next(i for i in unit if i in states) for unit in group if any(i in states for i in unit)]
    if not present:
        raise ValueError(f"no island of the group {[list(u) for u in group]} takes part")
    total = math.fsum(weights[i] for i in present)
    if len(present) == 1:
        return states[present[0]], total
    return merge([states[i] for i in present], [weights[i] for i in present]), total
