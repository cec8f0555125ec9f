"""The round header's wire form, and the one chunk loop that both kinds of round run through."""

from __future__ import annotations

import json
import threading
from dataclasses import fields

import pytest
import torch

from lightning_islands.engine import HeaderError, RoundHeader, StateSummary, exchange

FULL = RoundHeader(round=7, attempt=2, fragment=1, tokens=1536.0, steps=12, step_seconds=0.25,
                   experts={"layers.0.moe.w1": [3.0, 0.0, 5.5]}, stop=True, norm=0.125,
                   state=StateSummary(fragment=1, anchors=2**64 - 3, momentum=17, outer_steps=(4, 3)),
                   joining=True, absent=False)


def _through_json(header: RoundHeader) -> RoundHeader:
    return RoundHeader.from_wire(json.loads(json.dumps(header.to_wire())), header.round, 1)


def test_every_field_round_trips_through_the_wire_form():
    assert _through_json(FULL) == FULL
    # each field alone differs from the defaults, and survives the trip
    for f in fields(RoundHeader):
        if f.name == "round":
            continue
        one = RoundHeader(round=3, **{f.name: getattr(FULL, f.name)})
        assert getattr(_through_json(one), f.name) == getattr(FULL, f.name), f.name
    for summary in (StateSummary(0, 1, None, 5), StateSummary(2, 0, 0, (1, 2, 3))):
        assert _through_json(RoundHeader(0, state=summary)).state == summary


def test_an_island_not_present_has_an_absent_header():
    header = RoundHeader.from_wire(None, 4, 2)
    assert header == RoundHeader.absent_from(4) and header.absent and not header.votes and header.tokens == 0.0
    assert RoundHeader.absent_from(4, stop=True).stop


def test_another_wire_version_is_refused_naming_the_island_and_the_fix():
    wire = FULL.to_wire()
    with pytest.raises(HeaderError, match=r"island 2 sent a round 7 header of wire version 99.*same lightning_islands"):
        RoundHeader.from_wire({**wire, "v": 99}, 7, 2)
    with pytest.raises(HeaderError, match="version None"):
        RoundHeader.from_wire({k: v for k, v in wire.items() if k != "v"}, 7, 2)
    with pytest.raises(HeaderError, match=r"island 1's round 7 header is malformed \(KeyError"):
        RoundHeader.from_wire({k: v for k, v in wire.items() if k != "tokens"}, 7, 1)


def test_the_majority_groups_equal_summaries_and_skips_joiners_and_the_absent():
    from lightning_islands.engine.health import majority

    a, b = StateSummary(0, 1, None, 2), StateSummary(0, 9, None, 2)
    headers = [RoundHeader(0, state=b), RoundHeader(0, state=a), RoundHeader(0, state=a),
               RoundHeader(0, state=b, joining=True), RoundHeader.absent_from(0)]
    assert majority([_through_json(h) for h in headers]) == [1, 2]
    assert majority([RoundHeader(0, state=b), RoundHeader(0, state=a)]) == [0], "a tie: the lowest island's group"


@pytest.mark.parametrize("background", [False, True])
def test_both_kinds_of_round_move_their_chunks_through_the_one_loop(background, monkeypatch):
    """The synchronous round calls the chunk loop on the training thread, an overlapped one on the
    leader's background thread; the same function, with the round's chunks."""
    from test_streaming import run

    calls: list[tuple[str, int]] = []
    real = exchange.exchange_chunks

    def counted(ex, bounds, *args, **kwargs):  # noqa: ANN001, ANN202
        if ex is not None:  # the leader's call
            calls.append((threading.current_thread().name, len(bounds)))
        return real(ex, bounds, *args, **kwargs)

    import lightning_islands.engine.flight as flight_module
    import lightning_islands.engine.round as round_module

    monkeypatch.setattr(round_module, "exchange_chunks", counted)
    monkeypatch.setattr(flight_module, "exchange_chunks", counted)
    kw = {"exchange_chunk_mib": 64 * 4 / 2**20} | ({"overlap_steps": 1} if background else {})
    results = run([1, 2], kw, 8)
    assert torch.equal(results[0]["globals"][-1], results[1]["globals"][-1])
    # two rounds (steps 4 and 8) on each island's leader; with overlap the first flies in the leader's
    # background thread (named island{i}-round{r}) and the last is synchronous, on the rank's own thread
    flown = sorted(name for name, _ in calls if "-round" in name)
    assert len(calls) == 4 and flown == (["island0-round0", "island1-round0"] if background else [])
    assert all(n > 1 for _, n in calls), "the round moved in several chunks"
